"""The autoscaling controller on recorded metric series (built here): a load
step, a drop, noise around a threshold, a short spike; targets and reasons."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from cluster.orchestration.autoscale import (AutoscaleConfig, ControllerState, DecodeSignals, FleetSignals,
                                             FleetDecision, PoolBounds, PoolState, PrefillSignals, Reason, decide)

CAP_TPS = 10_000.0      # prompt tokens/s one prefill worker sustains
SEQS = 40.0             # sequences one decode worker holds
DT = 5.0                # controller interval, s


def config(**kw) -> AutoscaleConfig:
    base = dict(slo_ttft_ms=2000, slo_itl_ms=100, prefill=PoolBounds(1, 20), decode=PoolBounds(1, 20),
                predict_ahead_s=0.0, scale_in_hold_s=30.0, cooldown_out_s=15.0, cooldown_in_s=30.0,
                slo_scale_in_margin=0.7)
    base.update(kw)
    return AutoscaleConfig(**base)


def prefill(workers: int, rate: float, queued: int = 0, ttft: float | None = 500.0) -> PrefillSignals:
    return PrefillSignals(workers, workers, queued, rate, ttft, CAP_TPS)


def decode(workers: int, running: int, waiting: int = 0, kv: float | None = None,
           itl: float | None = 30.0) -> DecodeSignals:
    kv = running / (workers * SEQS) if kv is None else kv
    return DecodeSignals(workers, workers, running, waiting, kv, itl, SEQS)


def replay(cfg: AutoscaleConfig, series, p0: int = 2, d0: int = 2):
    """Feed a series of (prefill kwargs, decode kwargs) one interval apart, acting on
    each decision (the next signals carry the target as the worker count)."""
    state, p, d, out = ControllerState(), p0, d0, []
    for i, (pk, dk) in enumerate(series):
        dec, state = decide(cfg, FleetSignals(prefill(p, **pk), decode(d, **dk)), state, i * DT)
        out.append(dec)
        p, d = dec.prefill.target, dec.decode.target
    return out


def idle_decode():
    return {"running": 10}


def test_prefill_load_step_grows_then_holds():
    # 15k tokens/s on 2 workers is within target (0.8 x 20k = 16k); a step to 60k needs 8
    series = [({"rate": 15_000}, idle_decode())] * 4 + [({"rate": 60_000}, idle_decode())] * 12
    out = replay(config(), series)
    assert all(d.prefill.target == 2 and d.prefill.reason is Reason.STEADY for d in out[:4])
    step = out[4].prefill
    assert step.reason is Reason.LOAD and step.target == 3          # step limit: +50% of 2 -> +1
    # then bigger steps, spaced by the 15 s scale-out cool-down, up to ceil(60k / 8k) = 8
    targets = [d.prefill.target for d in out[4:]]
    assert targets == sorted(targets) and targets[-1] == 8
    reasons = {d.prefill.reason for d in out[5:]}
    assert Reason.COOLDOWN in reasons and reasons <= {Reason.LOAD, Reason.COOLDOWN, Reason.STEADY}
    assert out[-1].prefill.reason is Reason.STEADY and out[-1].prefill.needed == 8


def test_prefill_queue_drives_scale_out_when_the_rate_fits():
    # the rate fits 2 workers; 40k queued tokens must drain within 1 s (half the TTFT target)
    # while TTFT p90 is over its target (here 2.1 s of 2 s)
    out = replay(config(), [({"rate": 10_000, "queued": 40_000, "ttft": 2100.0}, idle_decode())])
    assert out[0].prefill.reason is Reason.QUEUE and out[0].prefill.target == 3
    # a burst that TTFT absorbs (p90 under target) is no reason to grow
    out = replay(config(), [({"rate": 10_000, "queued": 40_000, "ttft": 1900.0}, idle_decode())])
    assert out[0].prefill.reason is Reason.STEADY and out[0].prefill.target == 2


def test_ttft_miss_with_a_queue_grows_by_one_even_if_the_model_says_enough():
    # 3.5 s against 2 s: +75%, at most a step (+50%): 4 -> 6
    out = replay(config(), [({"rate": 1000, "queued": 100, "ttft": 3500.0}, idle_decode())], p0=4)
    assert out[0].prefill.reason is Reason.TTFT_SLO and out[0].prefill.target == 6
    # a small miss: at least one worker
    out = replay(config(), [({"rate": 1000, "queued": 100, "ttft": 2050.0}, idle_decode())], p0=4)
    assert out[0].prefill.reason is Reason.TTFT_SLO and out[0].prefill.target == 5
    # a miss without a queue (one long prompt): more prefill workers would not help
    out = replay(config(), [({"rate": 1000, "queued": 0, "ttft": 3500.0}, idle_decode())], p0=4)
    assert out[0].prefill.target == 4


def test_drop_shrinks_only_after_the_hold_and_stepwise_to_min():
    cfg = config(max_step_down=0.25, prefill=PoolBounds(2, 20), prefill_hold_factor=1.0)
    series = [({"rate": 1000}, idle_decode())] * 40
    out = replay(cfg, series, p0=8)
    targets = [d.prefill.target for d in out]
    # below the scale-in threshold from t=0; the hold is 30 s: no change before t=30 (index 6)
    assert targets[:6] == [8] * 6 and all(d.prefill.reason is Reason.STEADY for d in out[:6])
    assert out[6].prefill.reason is Reason.IDLE and targets[6] == 6       # -25% of 8
    # later steps are spaced by the 30 s scale-in cool-down, never below min (1)
    changes = [i for i in range(1, len(targets)) if targets[i] != targets[i - 1]] + [6]
    assert all(b - a >= 6 for a, b in zip(sorted(set(changes)), sorted(set(changes))[1:]))
    assert targets[-1] == 2 and out[-1].prefill.reason is Reason.AT_MIN
    assert targets == sorted(targets, reverse=True)


def test_noise_around_the_threshold_does_not_flap():
    # around 0.8 x 4 workers x 10k = 32k tokens/s, +-6%: inside the hysteresis band of 4 workers
    # after at most one scale-out, so never an up-down-up
    rng = random.Random(7)
    series = [({"rate": 32_000 * (1 + rng.uniform(-0.06, 0.06))}, idle_decode()) for _ in range(120)]
    out = replay(config(), series, p0=4)
    targets = [d.prefill.target for d in out]
    changes = [(a, b) for a, b in zip(targets, targets[1:]) if a != b]
    assert len(changes) <= 1 and all(b > a for a, b in changes)
    assert min(targets) == 4 and max(targets) <= 6


def test_spike_shorter_than_the_cooldown_adds_once_and_is_not_chased():
    # decode: a 2-interval spike right after a scale-out (inside the 15 s cool-down)
    base = {"running": 60}                    # 60 seqs on 2 workers of 40 at 0.8 -> fits (64)
    series = ([({"rate": 1000}, base)] * 2 + [({"rate": 1000}, {"running": 100})]
              + [({"rate": 1000}, {"running": 150})] * 2 + [({"rate": 1000}, base)] * 10)
    out = replay(config(), series)
    d = [x.decode for x in out]
    assert d[2].reason is Reason.LOAD and d[2].target == 3        # the step: +1 (50% of 2)
    assert d[3].reason is Reason.COOLDOWN and d[4].reason is Reason.COOLDOWN
    assert d[3].target == d[4].target == 3                        # the spike is not chased
    # after it, the load (60 seqs) is inside the band of 3 workers: held, not shrunk back and forth
    assert all(x.target == 3 for x in d[5:]) and all(x.reason is Reason.STEADY for x in d[5:])


def test_decode_kv_room_and_waiting_drive_scale_out():
    # few sequences but long contexts: KV at 95% on 2 workers needs 3 at 85%
    out = replay(config(), [({"rate": 1000}, {"running": 20, "kv": 0.95})])
    assert out[0].decode.reason is Reason.KV_ROOM and out[0].decode.target == 3
    # requests waiting while KV is full: at least one more even if the count looks fine
    out = replay(config(), [({"rate": 1000}, {"running": 20, "waiting": 1, "kv": 0.85})], d0=4)
    assert out[0].decode.reason is Reason.KV_ROOM and out[0].decode.target == 5
    # waiting with room to spare: a batch slot a step away, not a reason to grow
    out = replay(config(), [({"rate": 1000}, {"running": 20, "waiting": 1, "kv": 0.5})], d0=4)
    assert out[0].decode.reason is Reason.STEADY and out[0].decode.target == 4


def test_itl_miss_grows_decode_by_one_and_blocks_scale_in():
    out = replay(config(), [({"rate": 1000}, {"running": 10, "itl": 120.0})], d0=4)
    assert out[0].decode.reason is Reason.ITL_SLO and out[0].decode.target == 5      # +20% -> +1
    # over the hold time with low load but ITL near its target (over 70% of it): never IDLE
    series = [({"rate": 1000}, {"running": 10, "itl": 80.0})] * 20
    out = replay(config(), series, d0=20)
    assert all(x.decode.reason is not Reason.IDLE for x in out) and out[-1].decode.target == 20
    # well under it: shrinks
    series = [({"rate": 1000}, {"running": 10, "itl": 30.0})] * 20
    out = replay(config(), series, d0=20)
    assert out[-1].decode.target < 20 and Reason.IDLE in {x.decode.reason for x in out}


def test_bounds_at_max_and_at_min():
    out = replay(config(prefill=PoolBounds(1, 3)), [({"rate": 100_000}, idle_decode())] * 10)
    assert out[-1].prefill.target == 3 and out[-1].prefill.reason is Reason.AT_MAX
    assert out[-1].prefill.needed == 13
    # a pool outside its bounds (the operator changed them) is brought in at once
    dec, _ = decide(config(decode=PoolBounds(3, 5)), FleetSignals(prefill(2, 1000), decode(1, 10)),
                    ControllerState(), 0.0)
    assert dec.decode.target == 3 and dec.decode.reason is Reason.AT_MIN


def test_fleet_cap_shares_growth():
    cfg = config(max_total_workers=10, max_step_up=10.0, cooldown_out_s=0.0)
    dec, _ = decide(cfg, FleetSignals(prefill(2, 80_000), decode(2, 300)), ControllerState(), 0.0)
    # prefill wants 10, decode 10: 6 more fit, shared by what each asked for (8 and 8)
    assert dec.prefill.target + dec.decode.target == 10
    assert dec.prefill.target == 5 and dec.decode.target == 5
    # at the cap: no growth, AT_MAX, and no cool-down started
    dec, st = decide(cfg, FleetSignals(prefill(5, 80_000), decode(5, 300)), ControllerState(), 0.0)
    assert dec.prefill.reason is Reason.AT_MAX and dec.prefill.target == 5
    assert st.prefill.last_out_t == float("-inf")


def test_trend_predicts_a_ramp():
    cfg = config(predict_ahead_s=30.0, ewma_alpha=0.5, trend_alpha=0.5)
    # a ramp of +2k tokens/s per interval: the forecast 30 s ahead exceeds the last observation
    series = [({"rate": 10_000 + 2000 * i}, idle_decode()) for i in range(8)]
    out = replay(cfg, series, p0=10)
    assert out[-1].prefill.predicted_load > 10_000 + 2000 * 7


def test_decide_is_pure():
    cfg, st = config(), ControllerState()
    sig = FleetSignals(prefill(2, 60_000), decode(2, 10))
    a = decide(cfg, sig, st, 0.0)
    b = decide(cfg, sig, st, 0.0)
    assert a == b and st == ControllerState()


@pytest.mark.parametrize("bad", [
    lambda: PoolBounds(0, 3), lambda: PoolBounds(4, 3),
    lambda: config(slo_ttft_ms=0), lambda: config(scale_in_utilization=0.9),
    lambda: config(max_total_workers=1),
    lambda: PrefillSignals(2, 3, 0, 0.0, None, 1.0), lambda: PrefillSignals(2, 2, 0, 0.0, None, 0.0),
    lambda: DecodeSignals(2, 2, -1, 0, 0.0, None, 4.0)])
def test_invalid_inputs_say_how_to_fix(bad):
    with pytest.raises(ValueError):
        bad()


def test_reason_values_are_stable_labels():
    assert {r.value for r in Reason} == {"load", "queue", "ttft_slo", "kv_room", "itl_slo", "idle", "cooldown",
                                         "at_max", "at_min", "steady", "trade"}
    assert replace(prefill(1, 0.0), workers=2).workers == 2


def _waits(workers: int, miss: float | None, rate: float = 1000.0, queued: int = 0,
           ttft: float | None = 2500.0) -> FleetSignals:
    p = PrefillSignals(workers, workers, queued, rate, ttft, CAP_TPS, ttft_wait_miss_fraction=miss)
    return FleetSignals(p, decode(2, 10))


def test_wait_miss_fraction_grows_prefill_by_the_excess_and_ignores_long_prompts():
    cfg = config(ttft_miss_budget=0.01, ttft_miss_gain=0.25)
    # 3% of the requests that fit the target alone missed it by waiting: 0.25 x (3 - 1) = +50%
    dec, _ = decide(cfg, _waits(10, 0.03), ControllerState(), 0.0)
    assert dec.prefill.reason is Reason.TTFT_SLO and dec.prefill.target == 15
    # 1.5%: +12.5% of 10 -> at least 2 (rounded up)
    dec, _ = decide(cfg, _waits(10, 0.015), ControllerState(), 0.0)
    assert dec.prefill.reason is Reason.TTFT_SLO and dec.prefill.target == 12
    # within budget: the p90 over target comes from prompts too long to meet it on an idle
    # worker, and a queue with it is no reason to grow (the p90 rule alone would grow)
    dec, _ = decide(cfg, _waits(10, 0.005, queued=50_000), ControllerState(), 0.0)
    assert dec.prefill.target == 10 and dec.prefill.reason is Reason.STEADY
    dec, _ = decide(cfg, _waits(10, None, queued=50_000), ControllerState(), 0.0)
    assert dec.prefill.target > 10


def test_wait_misses_over_budget_count_the_queue_and_block_scale_in():
    cfg = config(ttft_miss_budget=0.01, scale_in_hold_s=0.0, cooldown_in_s=0.0)
    # the rate fits 1 worker; 40k queued tokens drain within 1 s only on 5 (at 0.8 x 10k)
    dec, _ = decide(cfg, _waits(4, 0.012, queued=40_000, ttft=1500.0), ControllerState(), 0.0)
    assert dec.prefill.target == 6 and dec.prefill.reason is Reason.QUEUE
    # idle by the rate, but misses above slo_scale_in_margin x budget: hold the size
    dec, _ = decide(cfg, _waits(10, 0.008, ttft=500.0), ControllerState(), 0.0)
    assert dec.prefill.target == 10
    dec, _ = decide(cfg, _waits(10, 0.0, ttft=500.0), ControllerState(), 0.0)
    assert dec.prefill.target < 10 and dec.prefill.reason is Reason.IDLE


def test_fleet_cap_decode_first_displaces_prefill():
    cfg = config(max_total_workers=10, max_step_up=10.0, cooldown_out_s=0.0, decode_first_under_cap=True,
                 prefill=PoolBounds(2, 20))
    # both want 10 with 6 free: decode takes its 6 first
    dec, _ = decide(cfg, FleetSignals(prefill(2, 80_000), decode(2, 300)), ControllerState(), 0.0)
    assert (dec.prefill.target, dec.decode.target) == (2, 8) and dec.prefill.reason is Reason.AT_MAX
    # at the cap, decode short of room: prefill gives workers up, down to its minimum
    dec, st = decide(cfg, FleetSignals(prefill(7, 10_000), decode(3, 300)), ControllerState(), 0.0)
    assert (dec.prefill.target, dec.decode.target) == (2, 8)
    assert st.prefill.last_change_t == 0.0 and st.prefill.last_out_t == float("-inf")
    assert dec.prefill.target + dec.decode.target <= 10


def test_wait_miss_fraction_must_be_a_fraction():
    with pytest.raises(ValueError, match="0..1"):
        PrefillSignals(2, 2, 0, 0.0, None, 1.0, ttft_wait_miss_fraction=1.5)
    with pytest.raises(ValueError, match="ttft_miss_budget"):
        config(ttft_miss_budget=0.0)


def test_scale_in_goes_no_lower_than_the_hold_window_needed():
    # decode on 10 workers (40 seqs each): a bursty load whose quiet samples (30 seqs) fit 2
    # workers and whose peaks (144 seqs: 3.6 workers' worth of KV, at 0.75 x 0.45 / 0.8 KV use)
    # need 9 must not shrink below 9 just because the sample when the hold ends is a quiet one
    # (the last sample alone would take it 10 -> 5 -> 3 -> 2)
    bursty = [{"running": 140}, {"running": 30}, {"running": 30}, {"running": 144}, {"running": 30}, {"running": 30}]
    cfg = config(scale_in_hold_s=25.0, max_step_down=0.5, ewma_alpha=1.0, scale_in_kv_usage=0.75 * 0.45 / 0.8)
    out = replay(cfg, [({"rate": 1000}, bursty[i % len(bursty)]) for i in range(30)], d0=10)
    shrinks = [d.decode for d in out if d.decode.target < d.decode.current]
    assert shrinks and all(d.reason is Reason.IDLE for d in shrinks)
    assert min(d.decode.target for d in out) == 9
    # the same quiet sample after a hold of quiet samples only: down a step (10 -> 5)
    out = replay(cfg, [({"rate": 1000}, {"running": 30})] * 8, d0=10)
    assert [d.decode.target for d in out if d.decode.delta] == [5]


def test_fleet_cap_counts_draining_workers():
    # 3 + 3 serving and 4 draining (still held, still paid for) under a cap of 10: no room to grow
    # until the drains end, however hard both pools ask
    cfg = config(max_total_workers=10, max_step_up=10.0, cooldown_out_s=0.0)
    dec, _ = decide(cfg, FleetSignals(prefill(3, 80_000), decode(3, 300), draining=4), ControllerState(), 0.0)
    assert (dec.prefill.target, dec.decode.target) == (3, 3)
    assert dec.prefill.reason is Reason.AT_MAX and dec.decode.reason is Reason.AT_MAX
    dec, _ = decide(cfg, FleetSignals(prefill(3, 80_000), decode(3, 300), draining=2), ControllerState(), 0.0)
    assert dec.prefill.target + dec.decode.target == 8
    with pytest.raises(ValueError, match="draining"):
        FleetSignals(prefill(3, 1000), decode(3, 10), draining=-1)


def test_waiting_requests_count_as_the_kv_they_will_take():
    # 10 workers at 70% KV (under the 75% target; long contexts, so the sequence count alone
    # asks for 6) and 40 requests waiting for room: they hold no KV yet and will take 40 / 40 = 1
    # worker's worth: (7 + 1) / 0.75 -> 11 workers
    out = replay(config(), [({"rate": 1000}, {"running": 150, "waiting": 40, "kv": 0.7})], d0=10)
    assert out[0].decode.reason is Reason.KV_ROOM and out[0].decode.target == 11
    # the same KV use with nothing waiting fits the 10 it has
    out = replay(config(), [({"rate": 1000}, {"running": 150, "kv": 0.7})], d0=10)
    assert out[0].decode.target == 10 and out[0].decode.reason is Reason.STEADY


def test_no_prompts_for_the_idle_hold_drains_both_pools_to_min_at_once():
    cfg = config(idle_hold_s=10.0, prefill=PoolBounds(2, 20), decode=PoolBounds(3, 20))
    busy = ({"rate": 60_000}, {"running": 150})
    quiet = ({"rate": 0.0}, {"running": 40})
    out = replay(cfg, [busy] * 4 + [quiet] * 4, p0=8, d0=6)
    # t=20 first quiet interval, t=25 still under the 10 s hold, t=30 the hold is over: both pools
    # go to their minimum in one decision (not a step per cool-down), decode with sequences still
    # running (the drained workers finish them)
    assert [(d.prefill.target, d.decode.target) for d in out[4:6]] == [(8, 6), (8, 6)]
    assert (out[6].prefill.target, out[6].decode.target) == (2, 3)
    assert out[6].prefill.reason is Reason.IDLE and out[6].decode.reason is Reason.IDLE
    assert out[7].prefill.reason is Reason.AT_MIN and out[7].decode.reason is Reason.AT_MIN
    # a lull shorter than the hold, or prompts still queued, is not idle
    out = replay(cfg, ([busy] + [quiet] * 2) * 4, p0=8, d0=6)
    assert all(d.prefill.reason is not Reason.IDLE and d.decode.reason is not Reason.IDLE for d in out)
    out = replay(cfg, [busy] + [({"rate": 0.0, "queued": 5000}, {"running": 40})] * 6, p0=8, d0=6)
    assert all(d.prefill.target == 8 and d.decode.target == 6 for d in out)
    # hand-offs waiting for a decode slot: the decode pool keeps its workers (prefill still shrinks)
    backlog = ({"rate": 0.0}, {"running": 40, "waiting": 90})
    out = replay(cfg, [busy] * 4 + [backlog] * 4, p0=8, d0=6)
    assert out[6].prefill.target == 2 and out[6].prefill.reason is Reason.IDLE
    assert all(d.decode.target == 6 for d in out)
    # off (None): the ordinary hold and steps only
    out = replay(config(idle_hold_s=None), [busy] * 4 + [quiet] * 4, p0=8, d0=6)
    assert all(d.prefill.target == 8 and d.decode.target == 6 for d in out)
    with pytest.raises(ValueError, match="idle_hold_s"):
        config(idle_hold_s=-1.0)


def test_prefill_waits_five_holds_before_shrinking():
    # the token rate fits one worker from t=0 and TTFT holds with margin: prefill keeps its 8
    # workers for 5 x the 30 s hold (its size is set by the TTFT tail, not the rate); decode
    # shrinks after one hold
    out = replay(config(max_step_down=0.25), [({"rate": 1000}, {"running": 10})] * 40, p0=8, d0=8)
    first = {pool: next(i for i, d in enumerate(out) if getattr(d, pool).target < getattr(d, pool).current)
             for pool in ("prefill", "decode")}
    assert first == {"prefill": 30, "decode": 6}        # t = 150 s and 30 s
    assert out[30].prefill.reason is Reason.IDLE and out[30].prefill.target == 6


def test_scale_in_goes_no_lower_than_the_memory_of_peaks():
    # one peak then quiet: decode shrinks after the 30 s hold, but not below what the peak needed
    # at the scale-in level until the peak is older than 3 holds (90 s); without the memory it
    # goes on down a step per cool-down
    series = [({"rate": 1000}, {"running": 160})] + [({"rate": 1000}, {"running": 10})] * 40
    targets = [d.decode.target for d in replay(config(max_step_down=0.5), series, d0=16)]
    assert targets[:6] == [16] * 6 and targets[6:18] == [9] * 12      # t = 30 s: 16 -> 9, the peak's need
    assert targets[18] < 9 and targets[-1] == 1                        # t = 90 s: the peak is forgotten
    targets = [d.decode.target for d in replay(config(max_step_down=0.5, scale_in_memory_factor=0.0), series, d0=16)]
    assert targets[6] == 8 and targets[12] == 4                        # a step per cool-down


def test_decode_gives_way_at_the_fleet_cap_without_its_hold():
    # after a first hold in which decode needed its 4 workers, prefill misses TTFT with a queue
    # at the cap of 10 (6 prefill + 4 decode) while decode holds 10 sequences: decode shrinks a
    # step at once, not after its 30 s hold, and prefill grows into the room (memory of peaks off)
    cfg = config(max_total_workers=10, max_step_up=10.0, cooldown_out_s=0.0, max_step_down=0.5,
                 scale_in_memory_factor=0.0)
    warm = [({"rate": 1000}, {"running": 60})] * 6
    hurting = {"rate": 10_000, "queued": 100_000, "ttft": 3000.0}
    out = replay(cfg, warm + [(hurting, {"running": 10})] * 3, p0=6, d0=4)
    assert all(d.decode.target == 4 for d in out[:6])
    assert out[6].decode.target < 4 and out[6].decode.reason is Reason.IDLE
    assert out[7].prefill.target == 10 - out[6].decode.target
    # off, or prefill not asking for more: decode waits out its hold
    off = replace(cfg, trade_at_cap=False)
    assert all(d.decode.target == 4 for d in replay(off, warm + [(hurting, {"running": 10})] * 3, p0=6, d0=4))
    assert all(d.decode.target == 4 for d in replay(cfg, warm + [({"rate": 1000}, {"running": 10})] * 3,
                                                    p0=6, d0=4))


def test_nothing_shrinks_before_the_controller_watched_for_one_hold():
    # the same trade from the first interval: the memory of peaks that bounds a shrink has seen
    # nothing yet, so decode holds until the controller has watched it for one hold (30 s), then
    # gives way
    cfg = config(max_total_workers=10, max_step_up=10.0, cooldown_out_s=0.0, max_step_down=0.5)
    hurting = {"rate": 10_000, "queued": 100_000, "ttft": 3000.0}
    targets = [d.decode.target for d in replay(cfg, [(hurting, {"running": 10})] * 8, p0=6, d0=4)]
    assert targets[:6] == [4] * 6 and targets[6] == 2


def test_idle_from_the_time_since_the_last_prompt():
    # the caller's rate is over a window that still holds the last prompts; the age of the last
    # prompt says the lull began 12 s ago: past the 10 s hold, both pools go to their minimum now
    cfg = config(idle_hold_s=10.0, prefill=PoolBounds(2, 20), decode=PoolBounds(3, 20))

    def first(queued: int, age: float) -> FleetDecision:
        sig = FleetSignals(PrefillSignals(8, 8, queued, 5000.0, 500.0, CAP_TPS, since_last_prompt_s=age), decode(6, 40))
        return decide(cfg, sig, ControllerState(), 100.0)[0]

    dec = first(0, 12.0)
    assert (dec.prefill.target, dec.decode.target) == (2, 3) and dec.prefill.reason is Reason.IDLE
    assert first(0, 8.0).prefill.target == 8            # younger than the hold
    assert first(100, 60.0).prefill.target == 8         # prompts still queued
    with pytest.raises(ValueError, match="since_last_prompt_s"):
        PrefillSignals(8, 8, 0, 0.0, None, CAP_TPS, since_last_prompt_s=-1.0)


def test_decode_holds_while_hand_offs_wait_on_full_workers():
    # at the cap prefill misses TTFT with a queue; decode's mean KV use is 0.2 (it would give way)
    # but 5 hand-offs wait and one of its 4 workers reports 0.77, over the 0.75 target: the waiting
    # sit on that worker, and a shrink would drain the ones with room, so decode holds its size.
    # Once nothing waits (or the fullest worker has room) it gives way as before; without
    # per-worker reports the mean decides as before.
    cfg = config(max_total_workers=10, max_step_up=10.0, cooldown_out_s=0.0, max_step_down=0.5)
    hurting = PrefillSignals(6, 6, 100_000, 10_000.0, 3000.0, CAP_TPS)

    def step(waiting: int, by_worker: tuple[float, ...]) -> FleetDecision:
        d = DecodeSignals(4, 4, 10, waiting, 0.2, 30.0, SEQS, kv_usage_by_worker=by_worker)
        return decide(cfg, FleetSignals(hurting, d), watched, 0.0)[0]

    watched = ControllerState(PoolState(first_t=-60.0), PoolState(first_t=-60.0))   # past the first hold
    full = (0.0, 0.01, 0.02, 0.77)
    held = step(5, full).decode
    assert (held.target, held.reason) == (4, Reason.STEADY)
    assert step(0, full).decode.target == 2                       # nothing waits: gives way
    assert step(5, (0.2, 0.2, 0.2, 0.2)).decode.target == 2       # the fullest has room
    assert step(5, ()).decode.target == 2                          # not reported: the mean decides
    # a recorded series: waiting on a full worker for 3 intervals, then drained
    state, targets = watched, []
    for i, (w, kv) in enumerate([(5, full)] * 3 + [(0, full)]):
        d = DecodeSignals(4, 4, 10, w, 0.2, 30.0, SEQS, kv_usage_by_worker=kv)
        dec, state = decide(cfg, FleetSignals(hurting, d), state, i * DT)
        targets.append(dec.decode.target)
    assert targets == [4, 4, 4, 2]
    with pytest.raises(ValueError, match="kv_usage_by_worker"):
        DecodeSignals(2, 2, 10, 0, 0.3, None, SEQS, kv_usage_by_worker=(0.1, 0.2, 0.3))


def test_at_the_fleet_cap_decode_grows_only_for_room_about_to_run_out():
    # a decode worker more at the cap is a prefill worker fewer: decode grows by its KV and load
    # rules past decode_grow_usage_at_cap (0.95), not past the targets (0.75 KV, 0.8 sequences)
    cfg = config(max_total_workers=10, decode_first_under_cap=True, max_step_up=10.0, cooldown_out_s=0.0)

    def at(p: int, **dk) -> FleetDecision:
        return decide(cfg, FleetSignals(prefill(p, 10_000), decode(3, **dk)), ControllerState(), 0.0)[0]

    # KV at 0.85 of 3 workers (2.55 worker units): over the 0.75 target, under 0.95
    below = at(5, running=20, kv=0.85)                       # 5 + 3 < 10: the target decides
    assert (below.decode.target, below.decode.reason) == (4, Reason.KV_ROOM)
    capped = at(7, running=20, kv=0.85)                      # 7 + 3 = 10: rides it
    assert (capped.prefill.target, capped.decode.target) == (7, 3) and capped.decode.reason is Reason.STEADY
    old = decide(replace(cfg, decode_grow_usage_at_cap=None), FleetSignals(prefill(7, 10_000),
                 decode(3, running=20, kv=0.85)), ControllerState(), 0.0)[0]
    assert (old.prefill.target, old.decode.target) == (6, 4)   # None: the target, prefill displaced
    # room about to run out at the cap: it grows, displacing prefill
    full = at(7, running=20, kv=0.97)
    assert (full.prefill.target, full.decode.target, full.decode.reason) == (6, 4, Reason.KV_ROOM)
    # hand-offs waiting: one more only once KV is past 0.95, at the cap
    assert at(7, running=20, waiting=1, kv=0.9).decode.target == 3
    assert at(7, running=20, waiting=1, kv=0.96).decode.target == 4
    # sequences: 110 on workers holding 40 need 4 at 80%, 3 at 95%
    assert at(5, running=110, kv=0.5).decode.target == 4
    assert at(7, running=110, kv=0.5).decode.target == 3


@pytest.mark.parametrize("grow", [0.7, 1.01])
def test_decode_grow_usage_at_cap_must_lie_between_the_targets_and_full(grow):
    with pytest.raises(ValueError, match="decode_grow_usage_at_cap must be in"):
        config(decode_grow_usage_at_cap=grow)

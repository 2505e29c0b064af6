"""The autoscaling controller (the real module) on the simulator's virtual clock:
pools grow under a load step and shrink back, and no request is lost or
duplicated by a scale-in."""
from __future__ import annotations

import json
import random

import pytest

from cluster.orchestration.autoscale import AutoscaleConfig, PoolBounds
from cluster.tools.sim.autoscale import SimAutoscale, worker_hours
from cluster.tools.sim.cluster_sim import ClusterSim, SimConfig
from cluster.tools.sim.cost_model import Table2D, TableCostModel, TransferCost
from cluster.tools.sim.workload import PromptBuilder, TraceRequest

BS = 16


def _cost():
    # ~1.1k prompt tokens/s per prefill node, ~10 ms decode steps
    prefill = Table2D("prefill", [1, 256, 1024], [0, 1024], [[0.01, 0.01], [0.2, 0.2], [0.8, 0.8]])
    decode = Table2D("decode", [1, 16], [0, 4096], [[0.008, 0.01], [0.01, 0.014]])
    return TableCostModel("test", prefill, decode, 0.001, TransferCost(1e-4, 1e-5, 1e9), 1000, 4096)


def _step_workload(seed=3):
    """4 req/s for 20 s, 40 req/s for 20 s, 4 req/s for 120 s; 128-token unique prompts (above the
    local-prefill threshold: prefilled remotely), 40-token outputs."""
    rng, t, out, i = random.Random(seed), 0.0, [], 0
    for rate, until in ((4.0, 20.0), (40.0, 40.0), (4.0, 160.0)):
        while True:
            t += rng.expovariate(rate)
            if t >= until:
                t = until
                break
            out.append(TraceRequest(f"s{i}", t, 128, 40, tuple(range(8 * i, 8 * i + 8))))
            i += 1
    return out


def _autoscale(**kw):
    # one hold for both pools and no memory of peaks (the controller's tests cover those): the
    # 4 req/s tail after the step is bursty enough at this scale to keep a pool one worker up for
    # 5 holds of 5 s
    kw = {"prefill_hold_factor": 1.0, "scale_in_memory_factor": 0.0, **kw}
    cfg = AutoscaleConfig(slo_ttft_ms=1000, slo_itl_ms=100, prefill=PoolBounds(1, 6), decode=PoolBounds(1, 10),
                          predict_ahead_s=2.0, scale_in_hold_s=5.0, cooldown_out_s=2.0, cooldown_in_s=4.0,
                          max_step_down=0.5, capacity_recovery_per_s=0.05, **kw)
    return SimAutoscale(cfg, interval_s=1.0, window_s=8.0, startup_s=2.0)


def _run(reqs, p=1, d=1, autoscale=None, reserve=True):
    # reserve: decode blocks reserved at routing, as the live cluster's default, for prefills that start
    # within a step (cluster/router/reserve.py; tests/unit/test_sim_reservation.py compares this step
    # with and without; docs/simulator.md, "Autoscaling", the figures)
    cfg = SimConfig(p, d, block_size=BS, num_blocks=64, max_num_batched_tokens=512, max_num_seqs=16,
                    max_model_len=2048, autoscale=autoscale, reserve_decode_blocks=reserve)
    sim = ClusterSim(cfg, _cost(), reqs, PromptBuilder(BS, tokens_per_id=16))
    return sim, sim.run()


def test_pools_grow_under_a_step_and_shrink_back_without_losing_a_request():
    reqs = _step_workload()
    sim, s = _run(reqs, autoscale=_autoscale())
    # every request finished once, with all its tokens
    ids = [r.request_id for r in sim.records]
    assert len(ids) == len(set(ids)) == len(reqs) == s["finished"] == s["requests"]
    assert all(r.tokens_out == r.output_tokens and r.finish_s is not None for r in sim.records)
    assert not sim.live
    # both pools grew under the step, and shrank back to their minimum after it
    a = s["autoscale"]
    assert a["peak_workers"]["prefill"] >= 2 and a["peak_workers"]["decode"] >= 3
    for pool in ("prefill", "decode"):
        mine = [c for c in a["changes"] if c["pool"] == pool]
        before = max([1] + [c["to"] for c in mine if c["t"] < 20.0])
        peak = a["peak_workers"][pool]
        assert peak > before
        # the growth to the peak came during the step (20-40 s, plus start-up and reaction)
        assert all(20.0 <= c["t"] <= 45.0 for c in mine if c["to"] > max(c["from"], before))
        # and after it the pool came back to its size before the step, by scale-ins for idleness
        assert len(sim.ready_nodes(pool)) <= before
        assert {c["reason"] for c in mine if c["to"] < c["from"]} == {"idle"}
        # no flapping: from the peak on, it only shrinks
        top = max(i for i, c in enumerate(mine) if c["to"] == peak)
        assert all(c["to"] < c["from"] for c in mine[top + 1:])
    # drained nodes left, took nothing after their drain, and hold no block
    assert sim.retired and not sim.draining
    for node in sim.retired:
        t = sim.drained_at[node.node_id]
        mine = [r for r in sim.records if node.node_id in (r.prefill_node, r.decode_node)]
        assert all(r.arrival_s <= t for r in mine)
        assert all(r.finish_s <= sim.spans[node.node_id][2] + 1e-9 for r in mine
                   if r.decode_node == node.node_id)
    for node in list(sim.nodes.values()) + sim.retired:
        sch = node.scheduler
        assert not sch.has_unfinished() and sch.num_held == 0
        sch.check_integrity()
        assert sch.kv.num_free_blocks == sch.kv.num_blocks
    # fewer worker-hours than a fixed fleet of the peak sizes; far more requests within the SLOs
    # than the fixed fleet it started as (1 + 1), which drowns in the step
    _, peak = _run(reqs, p=a["peak_workers"]["prefill"], d=a["peak_workers"]["decode"])
    assert s["fleet"]["worker_hours"]["total"] < 0.7 * peak["fleet"]["worker_hours"]["total"]
    _, small = _run(reqs, p=1, d=1)
    assert s["goodput"]["fraction"] >= 0.5 and s["goodput"]["fraction"] > small["goodput"]["fraction"] + 0.2


def test_fixed_fleet_worker_hours_are_nodes_times_span():
    reqs = _step_workload()[:100]
    sim, s = _run(reqs, p=2, d=3)
    span = s["duration_s"]
    wh = s["fleet"]["worker_hours"]
    assert wh["total"] == pytest.approx(5 * span / 3600)
    assert wh["prefill"] == pytest.approx(2 * span / 3600) and wh["decode"] == pytest.approx(3 * span / 3600)
    assert "autoscale" not in s and not sim.retired


def test_worker_hours_cut_spans_to_the_run():
    wh = worker_hours([("prefill", 0.0, 7200.0), ("decode", -10.0, 3600.0), ("decode", 5400.0, 9000.0)],
                      0.0, 7200.0)
    assert wh == {"total": pytest.approx(3.5), "decode": pytest.approx(1.5), "prefill": pytest.approx(2.0)}


def test_autoscale_is_deterministic():
    reqs = _step_workload()[:300]
    _, a = _run(reqs, autoscale=_autoscale())
    _, b = _run(reqs, autoscale=_autoscale())
    from cluster.tools.sim.cli import without_wall
    assert without_wall(a) == without_wall(b)


def test_autoscale_needs_a_prefill_pool():
    with pytest.raises(ValueError, match="prefill-nodes"):
        SimConfig(0, 2, autoscale=_autoscale())


def test_cli_autoscale_flags(tmp_path, capsys):
    from cluster.cli import main
    out = tmp_path / "as.json"
    args = ["simulate", "--synthetic", "120", "--synthetic-rate", "30", "--prefill-nodes", "1", "--decode-nodes", "1",
            "--tokens-per-id", "16", "--block-size", "16", "--num-blocks", "64", "--autoscale",
            "--slo-ttft-ms", "1500", "--slo-itl-ms", "80", "--min-prefill-workers", "1", "--max-prefill-workers", "3",
            "--min-decode-workers", "1", "--max-decode-workers", "4", "--max-total-workers", "6",
            "--autoscale-interval", "1", "--autoscale-window", "3", "--startup-delay", "1", "--output", str(out)]
    assert main(args) == 0
    s = json.loads(out.read_text())["runs"][0]["summary"]
    assert s["finished"] == s["requests"] == 120
    a = s["autoscale"]
    assert (a["slo_ttft_ms"], a["slo_itl_ms"], a["max_total_workers"]) == (1500, 80, 6)
    assert a["prefill_bounds"] == [1, 3] and a["decode_bounds"] == [1, 4]
    assert s["slo"] == {"ttft_s": 1.5, "itl_s": 0.08}
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["worker_hours"] > 0 and "peak_workers" in line
    # bounds that cannot hold are a clear error
    assert main([*args[:-2], "--min-decode-workers", "5"]) == 2
    assert "min workers <= max workers" in capsys.readouterr().err


def test_planned_split_gives_decode_the_peak_in_flight_and_prefill_the_rest():
    from cluster.tools.planner.pools import peak_rate, size_pools, split_at_cap
    from cluster.tools.sim.autoscale import decode_seqs_per_worker, planned_split, prefill_tokens_per_s
    cost, reqs = _cost(), _step_workload()
    p, d = planned_split(20, reqs, cost, 512, 64 * BS, 16)
    assert p + d == 20 and p >= 1 and d >= 1
    seqs = decode_seqs_per_worker(64 * BS, cost.kv_bytes_per_token, 168.0, 16)
    step = cost.pure_decode(int(seqs), int(seqs * 148))
    rate = len(reqs) / (reqs[-1].arrival_s - reqs[0].arrival_s)
    plan = size_pools(rate, 128, 40, prefill_tokens_per_s(cost, 512, 128.0), seqs / step)
    peak = peak_rate([r.arrival_s for r in reqs], 40 * step)
    assert peak > rate                                   # the step workload has a busy phase
    assert (p, d) == split_at_cap(20, plan, peak, 0.75)
    assert planned_split(20, reqs, cost, 512, 64 * BS, 16, target_kv_usage=0.5)[1] >= d
    with pytest.raises(ValueError, match="2 nodes"):
        planned_split(1, reqs, cost, 512, 64 * BS, 16)


def test_prefill_alone_is_its_uncached_chunks():
    from cluster.tools.sim.cost_model import prefill_alone_s
    calls = []

    def pure(n, cached):
        calls.append((n, cached))
        return n / 1000.0

    assert prefill_alone_s(pure, 512, 1300, 100) == pytest.approx(1.2)
    assert calls == [(512, 100), (512, 612), (176, 1124)]
    assert prefill_alone_s(pure, 512, 100, 100) == 0.0


def test_wait_miss_fraction_reaches_the_controller(monkeypatch):
    import cluster.tools.sim.autoscale as sim_autoscale
    seen, real = [], sim_autoscale.decide

    def spy(config, signals, state, now):
        seen.append(signals.prefill.ttft_wait_miss_fraction)
        return real(config, signals, state, now)

    monkeypatch.setattr(sim_autoscale, "decide", spy)
    reqs = _step_workload()
    _run(reqs, autoscale=_autoscale())
    assert seen and all(f is None for f in seen)                 # off by default: the p90 decides
    seen.clear()
    spec = SimAutoscale(_autoscale().config, interval_s=1.0, window_s=8.0, startup_s=2.0, ttft_wait_misses=True)
    sim, s = _run(reqs, autoscale=spec)
    measured = [f for f in seen if f is not None]
    assert measured and all(0.0 <= f <= 1.0 for f in measured) and max(measured) > 0.0   # the step misses
    assert s["finished"] == len(reqs) and s["autoscale"]["peak_workers"]["prefill"] >= 2


def test_under_the_fleet_cap_a_new_node_waits_for_a_drained_nodes_gpu():
    """The cap is the GPUs the fleet owns: a node started while a drained one still finishes what it
    holds waits for its GPU, unpaid (as a pending Ray actor), counts as its pool's worker meanwhile,
    and boots when the drained node leaves; cancelling it first gives nothing back."""
    cfg = SimConfig(1, 2, block_size=BS, num_blocks=64, max_num_batched_tokens=512, max_num_seqs=16,
                    max_model_len=2048, autoscale=_autoscale(max_total_workers=3))
    sim = ClusterSim(cfg, _cost(), _step_workload()[:4], PromptBuilder(BS, tokens_per_id=16))
    busy = sorted(n.node_id for n in sim.ready_nodes("decode"))[0]
    sim._hold(busy)                                  # a live request on it: draining, it stays
    sim.refs[sorted(n.node_id for n in sim.ready_nodes("decode"))[1]] += 2   # the other holds more
    sim.shrink("decode", 1)
    assert sim.draining == {busy} and sim.gpus_held() == 3
    first, second = sim.provision("prefill", 5.0), sim.provision("prefill", 5.0)
    assert sim.starting_count("prefill") == 2 and not sim.starting["prefill"]
    assert first not in sim.spans and second not in sim.spans          # not paid while waiting
    sim.shrink("prefill", 1)                                           # the newest waiting one goes
    assert list(sim.pending) == [first] and sim.starting_count("prefill") == 1
    sim.loop.clock.advance_to(7.0)
    sim._unhold(busy)                                                  # the drained node leaves
    assert sim.spans[busy][2] == 7.0 and not sim.pending
    assert sim.spans[first][1] == 7.0 and first in sim.starting["prefill"] and sim.gpus_held() == 3


def test_without_a_cap_a_new_node_boots_at_once():
    cfg = SimConfig(1, 2, block_size=BS, num_blocks=64, max_num_batched_tokens=512, max_num_seqs=16,
                    max_model_len=2048, autoscale=_autoscale())
    sim = ClusterSim(cfg, _cost(), _step_workload()[:4], PromptBuilder(BS, tokens_per_id=16))
    busy = sorted(n.node_id for n in sim.ready_nodes("decode"))[0]
    sim._hold(busy)
    sim.shrink("decode", 1)
    nid = sim.provision("prefill", 5.0)
    assert nid in sim.starting["prefill"] and nid in sim.spans and not sim.pending

"""The marginal trade at the fleet cap (cluster/orchestration/autoscale/trade.py): the M/M/1
prefill model against its closed form, decode's KV cost, and the controller on recorded series."""
from __future__ import annotations

import math

import numpy

from cluster.orchestration.autoscale import (AutoscaleConfig, ControllerState, DecodeSignals, FleetSignals,
                                             PoolBounds, PrefillSignals, Reason, decide)
from cluster.orchestration.autoscale.trade import (decode_cost, miss_elasticity, prefill_miss_after,
                                                   prefill_saving, workers_to_trade)

CAP_TPS = 10_000.0
SEQS = 40.0


def test_prefill_misses_follow_the_calibrated_mm1_tail():
    # measured: 2 workers at rho 0.5 and a slack of mu t = 2 service times miss 0.5 e^-1;
    # with 2 more, rho 0.25: 0.25 e^-(2 x 0.75)
    miss = 0.5 * math.exp(-2 * 0.5)
    assert prefill_miss_after(miss, 0.5, 2, 0) == miss
    assert math.isclose(prefill_miss_after(miss, 0.5, 2, 2), 0.25 * math.exp(-1.5), rel_tol=1e-12)
    after = [prefill_miss_after(miss, 0.5, 2, k) for k in range(6)]
    assert after == sorted(after, reverse=True) and after[-1] > 0
    # where the queue model cannot hold the measurement (m >= rho, or saturated), misses scale with rho
    assert math.isclose(prefill_miss_after(0.6, 0.5, 4, 1), 0.6 * 4 / 5)
    assert math.isclose(prefill_miss_after(0.3, 1.2, 4, 4), 0.15)


# recorded (save33): the autoscaled 100 x 12 run on main (docs/sim/autoscale_sim.json,
# reclaim33_not_landed.main_rerun), prefill's (utilisation of the ready workers, wait-miss
# fraction) every 15 s from 120 to 285 s; at 285 s: 70 workers, rho 0.3201, miss 0.0609
RECORDED_100X12 = ((0.2592, 0.0059), (0.2085, 0.0058), (0.3002, 0.0479), (0.3484, 0.0649), (0.2301, 0.0396),
                   (0.2187, 0.0186), (0.1977, 0.0058), (0.1638, 0.001), (0.2489, 0.0151), (0.2754, 0.0317),
                   (0.3057, 0.0299), (0.3201, 0.0609))


def test_miss_elasticity_is_the_least_squares_slope_of_the_logs():
    # the reference: numpy's least-squares fit of ln miss on ln rho
    ref = numpy.polyfit(numpy.log([r for r, _ in RECORDED_100X12]), numpy.log([m for _, m in RECORDED_100X12]), 1)[0]
    assert math.isclose(miss_elasticity(RECORDED_100X12), ref, rel_tol=1e-9)
    assert 4.5 < ref < 5.2                 # misses rise ~ rho^4.8 here; M/M/1 at 285 s says 1 + mu t rho = 1.8
    # an exact power law gives its exponent; intervals without a miss say nothing about the slope
    law = tuple((r, 0.5 * r ** 3) for r in (0.1, 0.2, 0.4)) + ((0.3, 0.0),)
    assert math.isclose(miss_elasticity(law), 3.0, rel_tol=1e-9)
    assert miss_elasticity(((0.2, 0.01),)) is None and miss_elasticity(((0.2, 0.01), (0.2, 0.03))) is None
    assert miss_elasticity(((0.2, 0.03), (0.4, 0.01))) < 0          # misses fell as load rose


def test_measured_convexity_raises_the_saving_where_misses_follow_the_load_steeply():
    # why the two estimates differ: the M/M/1 tail at the window's mean rho (0.32) has a local slope
    # d ln m / d ln rho of 1 + mu t rho = 1.8, but over the memory the misses rose as rho^4.8 (they come
    # from bursts inside the windows); one more of 70 workers then saves 2.7x as much
    m, rho, b = 0.0609, 0.3201, miss_elasticity(RECORDED_100X12)
    queue, measured = prefill_saving(m, 0.002, rho, 70, 1), prefill_saving(m, 0.002, rho, 70, 1, b)
    assert math.isclose(prefill_miss_after(m, rho, 70, 1, b), m * (70 / 71) ** b)
    assert 0.0014 < queue < 0.0016 and 0.0039 < measured < 0.0042
    # a decode burst that 29 of 30 workers hold 0.4 worker units over the target costs 0.0024 of the
    # requests: the M/M/1 saving does not pay for it, the measured one does (the second worker's
    # cost, 0.75 units, does not)
    demand = (11.61, 6.24, 19.86, 19.87, 8.63, 11.26, 8.8, 4.08, 14.01, 7.65, 19.77, 9.63, 22.15)
    assert queue < decode_cost(demand, 30, 1, 0.75) < measured < decode_cost(demand, 30, 2, 0.75)
    assert workers_to_trade(m, 0.002, rho, 70, demand, 30, 1, 0.75, 6) == 0
    assert workers_to_trade(m, 0.002, rho, 70, demand, 30, 1, 0.75, 6, b) == 1
    # a flat or falling slope (100 x 8: misses barely follow the load) never lowers the queue
    # model's figure: the fitted slope only raises it
    for flat in (None, -0.3, 0.5, 1.0):
        assert prefill_saving(m, 0.002, rho, 70, 1, flat) == queue


def test_prefill_saving_counts_misses_over_the_budget_only():
    assert prefill_saving(0.001, 0.002, 0.3, 10, 1) == 0.0
    s1, s2 = prefill_saving(0.05, 0.002, 0.3, 10, 1), prefill_saving(0.05, 0.002, 0.3, 10, 2)
    assert s1 > s2 > 0                                   # diminishing returns
    assert math.isclose(s1, 0.05 - prefill_miss_after(0.05, 0.3, 10, 1))


def test_decode_cost_is_the_demand_one_fewer_worker_holds_over_the_target():
    # 10 workers at a 0.75 target hold 7.5 worker units; 9 hold 6.75
    quiet = (3.0, 4.0, 5.0, 6.0)
    assert decode_cost(quiet, 10, 1, 0.75) == 0.0
    burst = quiet + (7.0,)
    assert math.isclose(decode_cost(burst, 10, 1, 0.75), 0.25 / sum(burst))
    assert math.isclose(decode_cost(burst, 10, 2, 0.75), 0.75 / sum(burst))     # 8 hold 6.0: 1.0 - 0.25 more
    assert decode_cost((), 10, 1, 0.75) == 0.0 and decode_cost((1.0,), 1, 1, 0.75) == math.inf


def test_workers_to_trade_stops_where_the_saving_no_longer_pays():
    quiet = (3.0,) * 10
    # decode never needed more than 4 workers at the target: it gives its step, down to its floor
    assert workers_to_trade(0.05, 0.002, 0.3, 10, quiet, 10, 1, 0.75, 3) == 3
    assert workers_to_trade(0.05, 0.002, 0.3, 10, quiet, 10, 8, 0.75, 3) == 2
    # within budget nothing moves; a burst that 9 workers hold over the target costs more than it saves
    assert workers_to_trade(0.001, 0.002, 0.3, 10, quiet, 10, 1, 0.75, 3) == 0
    assert workers_to_trade(0.05, 0.002, 0.3, 10, quiet + (7.4,), 10, 1, 0.75, 3) == 0


def _config() -> AutoscaleConfig:
    return AutoscaleConfig(slo_ttft_ms=2000, slo_itl_ms=100, prefill=PoolBounds(1, 20), decode=PoolBounds(1, 20),
                           max_total_workers=16, decode_first_under_cap=True, predict_ahead_s=0.0,
                           scale_in_hold_s=30.0, scale_in_memory_factor=2.0, cooldown_out_s=15.0,
                           cooldown_in_s=30.0, max_step_down=0.5, ttft_miss_budget=0.002)


def _replay(series, p0: int = 8, d0: int = 8):
    """(wait-miss fraction, decode KV use) per 5 s interval; the prefill pool asks for more at
    the cap (3 s TTFT, a queue), decode holds 150 short sequences (its own scale-in sees no room:
    150 at 45% of 40 need 9 workers; at the target, 80%, 5); act on each decision."""
    cfg, state, p, d, out = _config(), ControllerState(), p0, d0, []
    for i, (miss, kv) in enumerate(series):
        ps = PrefillSignals(p, p, 50_000, 30_000.0, 3000.0, CAP_TPS, ttft_wait_miss_fraction=miss)
        ds = DecodeSignals(d, d, 150, 0, kv, 30.0, SEQS)
        dec, state = decide(cfg, FleetSignals(ps, ds), state, i * 5.0)
        out.append(dec)
        p, d = dec.prefill.target, dec.decode.target
    return out


def test_decode_gives_way_by_marginal_value_after_its_memory():
    # recorded: decode's KV use 0.2-0.3 of 8 workers (at most 2.4 worker units: 4 hold it under
    # 0.75), prefill missing 5% by waiting at rho 0.375. Nothing moves before the memory (2 holds,
    # 60 s) is full; then decode gives 4 (its own ask at the cap, 150 at 95% of 40 per worker: 4,
    # is the floor) and prefill grows into the room
    series = [(0.05, 0.2 + 0.1 * (i % 2)) for i in range(16)]
    out = _replay(series)
    assert all(d.decode.target == 8 for d in out[:12])
    assert (out[12].decode.target, out[12].decode.reason) == (4, Reason.TRADE)
    assert out[12].prefill.target == 12
    # a burst in the memory (0.75 of 8: 6 worker units) that 7 workers would hold over the
    # target (5.25): its cost outweighs what one more prefill worker saves; decode keeps its 8
    burst = series[:6] + [(0.05, 0.75)] + series[7:]
    assert all(d.decode.target == 8 for d in _replay(burst))
    # misses within the budget: no trade
    assert all(d.decode.target == 8 for d in _replay([(0.001, 0.2)] * 16))

"""Host interference measured in situ (cluster/tools/sim/insitu.py): step shapes
priced like the scheduler's own outputs, the factor table and the frontend's
cost recovered from known traces, and the simulator applying them."""
from __future__ import annotations

import math

import pytest

from cluster.tools.sim.cluster_sim import ClusterSim, SimConfig
from cluster.tools.sim.cost_model import Table2D, TableCostModel, TransferCost
from cluster.tools.sim.insitu import (FrontendCost, Interference, fit_frontend, fit_interference, frontend_spans,
                                occupancy, step_kind)
from cluster.tools.sim.step_fit import shape_sched
from cluster.tools.sim.workload import PromptBuilder, synthetic_shared_prefix
from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_trace import StepRecord, StepShape

BS = 16


def _cost():
    prefill = Table2D("prefill", [1, 256, 1024], [0, 1024], [[0.002, 0.003], [0.02, 0.025], [0.08, 0.1]])
    decode = Table2D("decode", [1, 16], [0, 4096], [[0.002, 0.004], [0.004, 0.008]])
    return TableCostModel("test", prefill, decode, 0.001, TransferCost(1e-4, 1e-5, 1e9), 1000, 4096)


def test_a_traced_shape_costs_what_the_scheduler_output_costs():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), CacheConfig(block_size=BS, num_blocks=64),
                  64, 1024)
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    s.add_request(Request("a", list(range(3, 40)), p))
    out = s.schedule()
    s.update_from_output(out, {q.request.request_id: [1] for q in out.seqs if q.sample})
    s.add_request(Request("b", list(range(5, 90)), p))
    out = s.schedule()                      # a decodes, b prefills a 63-token chunk: a mixed step
    shape = StepShape.of(out)
    assert shape == StepShape(((63, 0),), (38,)) and step_kind(shape) == "mixed"
    cost = _cost()
    assert cost.step_seconds(shape_sched(shape)) == pytest.approx(cost.step_seconds(out))
    assert step_kind(StepShape(((5, 0),), ())) == "prefill" and step_kind(StepShape((), (9, 12))) == "decode"


def _rec(t, wall, shape=StepShape((), (100,))):
    return StepRecord(t, wall, wall, 0.0, 0.0, shape)


def test_fit_recovers_the_slowdown_by_other_busy_nodes():
    cost = _cost()
    shape = StepShape((), (100,))
    base = cost.step_seconds(shape_sched(shape))
    # node a decodes back to back; node b runs a long prefill for the middle third
    a = []
    t = 1000.0
    while t < 1003.0:
        busy_b = 1001.0 <= t < 1002.0
        wall = base * (2.5 if busy_b else 1.2)
        a.append(_rec(t, wall))
        t += wall
    b = [StepRecord(1001.0, 1.0, 1.0, 0.0, 0.0, StepShape(((1024, 0),), ()))]
    occ = occupancy({"a": a, "b": b})
    assert occ["b"][0].tolist() == [0.0, 1.0]                             # a was busy throughout b's step
    assert sum(f[1] * r.wall_s for f, r in zip(occ["a"], a)) == pytest.approx(1.0, abs=0.01)
    inter = fit_interference([{"a": a, "b": b}], {"a": "decode", "b": "prefill"}, cost)
    row = inter.factors["decode"]["decode"]
    assert row[0] == pytest.approx(1.2, rel=0.02) and row[1] == pytest.approx(2.5, rel=0.02)
    assert inter.factor("decode", "decode", 5) == row[1]                 # beyond the table: its last entry
    assert inter.factor("decode", "mixed", 0) == row[0]                  # no mixed steps seen: decode's
    assert inter.factor("colocated", "decode", 1) == 1.0                 # a role never seen: no slowdown
    assert inter.samples["prefill"]["prefill"] == (0, 1)
    assert Interference.from_json(inter.to_json()) == inter


def test_factors_do_not_fall_as_more_parties_are_busy_unless_asked():
    cost = _cost()
    base = cost.step_seconds(shape_sched(StepShape((), (100,))))
    # a decodes back to back; b is busy in [1001, 1002), c in [1001.5, 1002). The traces say a ran
    # *faster* with two others busy (2.0x) than with one (2.5x): noise a fit should not believe
    a = []
    t = 1000.0
    while t < 1003.0:
        k = (1001.0 <= t < 1002.0) + (1001.5 <= t < 1002.0)
        wall = base * (1.2, 2.5, 2.0)[k]
        a.append(_rec(t, wall))
        t += wall
    b = [StepRecord(1001.0, 1.0, 1.0, 0.0, 0.0, StepShape(((1024, 0),), ()))]
    c = [StepRecord(1001.5, 0.5, 0.5, 0.0, 0.0, StepShape(((1024, 0),), ()))]
    traces, roles = {"a": a, "b": b, "c": c}, {"a": "decode", "b": "prefill", "c": "prefill"}
    free = fit_interference([traces], roles, cost, monotone=False).factors["decode"]["decode"]
    assert free == pytest.approx((1.2, 2.5, 2.0), rel=0.03)
    row = fit_interference([traces], roles, cost).factors["decode"]["decode"]
    assert row[0] == pytest.approx(1.2, rel=0.03)
    assert row[1] == pytest.approx(row[2]) and 2.0 < row[1] < 2.5       # the two pooled


def test_frontend_cost_and_spans():
    # 0.01 s per arrival, 0.002 s per token, 0.001 s/s idle; samples every 20 ms
    arrivals = [0.1 * i for i in range(50)]
    tokens = [0.05 + 0.03 * i for i in range(150)]
    samples, cpu, t = [], 0.0, 0.0
    while t < 5.0:
        samples.append([t, cpu])
        nxt = t + 0.02
        cpu += 0.001 * 0.02 + 0.01 * sum(t <= x < nxt for x in arrivals) + 0.002 * sum(t <= x < nxt for x in tokens)
        t = nxt
    fe = fit_frontend([(samples, arrivals, tokens)])
    assert fe.arrival_s == pytest.approx(0.01, rel=0.05) and fe.token_s == pytest.approx(0.002, rel=0.05)
    spans = frontend_spans(FrontendCost(0.5, 0.1), [0.0, 0.2, 3.0], [0.25])
    assert spans == [(0.0, 1.1), (3.0, 3.5)]
    with pytest.raises(ValueError, match="at least 3 windows"):
        fit_frontend([([[0, 0], [1, 1]], [], [])])
    with pytest.raises(ValueError, match=">= 0"):
        FrontendCost(-1.0, 0.0)


def test_bad_tables_and_traces_are_refused():
    with pytest.raises(ValueError, match="positive numbers"):
        Interference({"decode": {"decode": (1.0, 0.0)}})
    with pytest.raises(ValueError, match="step kind"):
        Interference({"decode": {"bogus": (1.0,)}})
    with pytest.raises(ValueError, match="step_trace_size"):
        fit_interference([{"a": []}], {"a": "decode"}, _cost())
    with pytest.raises(ValueError, match="no role"):
        fit_interference([{"a": [_rec(1.0, 0.1)]}], {}, _cost())
    with pytest.raises(ValueError, match="pdserve-sim-interference/1"):
        Interference.from_json({"factors": {}})


def _sim(inter):
    reqs = synthetic_shared_prefix(60, 20.0, num_prefixes=4, prefix_ids=4, suffix_ids=1, output_length=10,
                                   tokens_per_id=16, seed=3)
    cfg = SimConfig(1, 2, block_size=BS, num_blocks=256, max_num_batched_tokens=512, max_num_seqs=16,
                    max_model_len=2048, collapse=False, interference=inter)
    sim = ClusterSim(cfg, _cost(), reqs, PromptBuilder(BS, tokens_per_id=16))
    return sim, sim.run()


def test_the_simulator_applies_the_table():
    _, plain = _sim(None)
    _, ones = _sim(Interference({"decode": {"decode": (1.0,)}, "prefill": {"prefill": (1.0,)}},
                                frontend=FrontendCost(0.001, 0.0001)))
    assert ones["ttft_s"] == plain["ttft_s"] and ones["itl_s"] == plain["itl_s"]   # factor 1: nothing changes
    slow_sim, slow = _sim(Interference({"decode": {"decode": (1.0, 3.0)}, "prefill": {"prefill": (1.0,)}}))
    assert slow["finished"] == plain["finished"] == 60
    assert slow["itl_s"]["mean"] > 1.3 * plain["itl_s"]["mean"]
    assert math.isclose(slow["ttft_s"]["mean"], plain["ttft_s"]["mean"], rel_tol=0.5)
    for node in slow_sim.nodes.values():
        node.scheduler.check_integrity()
        assert node.scheduler.kv.num_free_blocks == node.scheduler.kv.num_blocks


def test_jitter_is_the_spread_the_factors_do_not_explain():
    import random
    cost = _cost()
    base = cost.step_seconds(shape_sched(StepShape((), (100,))))
    rng = random.Random(5)
    a, t = [], 1000.0
    for _ in range(400):                       # alone on the host: 1.5x, times 0.8 or 1.2 at random
        wall = base * 1.5 * rng.choice((0.8, 1.2))
        a.append(_rec(t, wall))
        t += wall
    inter = fit_interference([{"a": a}], {"a": "decode"}, cost, jitter=True)
    assert inter.factors["decode"]["decode"][0] == pytest.approx(1.5, rel=0.03)
    q = inter.jitter["decode"]["decode"]
    assert len(q) == 21 and list(q) == sorted(q)
    assert inter.jitter_at("decode", "decode", 0.2) == pytest.approx(0.8, rel=0.03)
    assert inter.jitter_at("decode", "decode", 0.8) == pytest.approx(1.2, rel=0.03)
    assert sum(q) / len(q) == pytest.approx(1.0, abs=0.03)
    assert inter.jitter_at("prefill", "prefill", 0.9) == 1.0                    # no table: no jitter
    assert Interference.from_json(inter.to_json()) == inter
    assert fit_interference([{"a": a}], {"a": "decode"}, cost).jitter == {}             # off by default
    with pytest.raises(ValueError, match="increasing order"):
        Interference({"decode": {"decode": (1.0,)}}, jitter={"decode": {"decode": (1.2, 0.8)}})


def test_the_simulator_draws_jitter_per_step():
    flat = {"decode": {"decode": (1.0,)}, "prefill": {"prefill": (1.0,)}}
    _, plain = _sim(Interference(flat))
    spread = {"decode": {"decode": (0.5, 0.75, 1.0, 1.25, 1.5)}}
    _, jit = _sim(Interference(flat, jitter=spread))
    _, again = _sim(Interference(flat, jitter=spread))
    assert (jit["itl_s"], jit["ttft_s"]) == (again["itl_s"], again["ttft_s"])      # seeded: reproducible
    assert jit["finished"] == plain["finished"] == 60
    assert jit["itl_s"]["p99"] > plain["itl_s"]["p99"]
    assert jit["itl_s"]["mean"] == pytest.approx(plain["itl_s"]["mean"], rel=0.15)

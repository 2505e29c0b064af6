"""benchmarks/routing_sim.py: its workloads, ideal hit rate, and one small simulated comparison."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def rs():
    sys.path.insert(0, str(BENCH))            # it imports routing_workloads
    try:
        spec = importlib.util.spec_from_file_location("routing_sim", BENCH / "routing_sim.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_shared_prefix_ideal_hit_rate_misses_each_system_prompt_once(rs):
    reqs = rs.shared_prefix(2, 3, 384, 32, rate=10.0, seed=0)
    assert len(reqs) == 6 and all(r.input_length == 416 and len(r.hash_ids) == 26 for r in reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert rs.ideal_hit_rate(reqs) == pytest.approx(2 * 2 * 384 / (6 * 416))
    assert rs.shared_prefix(2, 3, 384, 32, 10.0, 0) == reqs               # seeded


def test_prefix_aware_reaches_the_ideal_where_round_robin_does_not(rs):
    args = argparse.Namespace(prefill_workers=2, kv_blocks=128)
    reqs = rs.shared_prefix(3, 6, 384, 32, rate=2.0, seed=1)
    pa = rs.simulate(reqs, "prefix_aware", 6.0, args)
    rr = rs.simulate(reqs, "round_robin", 1.0, args)
    assert pa["hit_rate"] == pytest.approx(rs.ideal_hit_rate(reqs), abs=1e-3)
    assert rr["hit_rate"] < pa["hit_rate"]


def _mooncake(rs, load: float = 1.2, seed: int = 1):
    from dataclasses import replace
    return [replace(r, arrival_s=r.arrival_s / load) for r in rs.mooncake(40, 0.071, 4092, seed, 64)]


def _args(**kw):
    return argparse.Namespace(prefill_workers=4, kv_blocks=2048, max_num_batched_tokens=2048, trace_block_len=64,
                              **kw)


def test_the_service_floor_is_under_every_policy_and_the_pooled_bound_hits_the_ideal(rs):
    reqs, args = _mooncake(rs), _args()
    floor = rs.service_floor(reqs, args, 64)
    assert floor["hit_rate"] == pytest.approx(rs.ideal_hit_rate(reqs, 64), abs=1e-4)
    for policy in ("round_robin", "prefix_aware"):
        run = rs.simulate(reqs, policy, 6.0, args)
        for q in ("p50", "p90", "mean"):
            assert floor[f"ttft_{q}_s"] <= run[f"ttft_{q}_s"], (policy, q)
    pooled = rs.pooled_bound(reqs, args)
    assert pooled["hit_rate"] == pytest.approx(floor["hit_rate"], abs=0.01)


def test_the_prefill_gate_holds_arrivals_and_loses_none(rs):
    from cluster.router import CostWeights, PolicyConfig
    from cluster.tools.sim.cluster_sim import ClusterSim, SimConfig
    from cluster.tools.sim.cost_model import load_cost_model
    from cluster.tools.sim.workload import PromptBuilder

    reqs = _mooncake(rs, load=6.0)                                   # 40 conversations: a busy pool
    out = {}
    for limit in (-1, 0):
        cfg = SimConfig(4, 1, policy_config=PolicyConfig(0.0, 0, 1.0, weights=CostWeights()), block_size=16,
                        num_blocks=2048, max_num_batched_tokens=2048, max_num_seqs=64, prefill_queue_limit=limit)
        sim = ClusterSim(cfg, load_cost_model("cpu"), reqs, PromptBuilder(16, 64))
        summary = sim.run()
        assert not sim.held and not sim.live
        assert sorted((r.request_id, r.arrival_s) for r in sim.records) == sorted(
            (r.request_id, r.arrival_s) for r in reqs)              # TTFT counts from the arrival
        assert all(r.finish_s is not None for r in sim.records)
        out[limit] = summary
    assert out[-1]["sim"]["prefill_gate_held"] == 0
    assert out[0]["sim"]["prefill_gate_held"] > len(reqs) // 4       # under this load the gate holds many
    assert out[0]["hit_rate_tokens"] >= 0.9 * rs.ideal_hit_rate(reqs, 64)


def test_a_measured_profile_file_sets_the_floor_in_its_own_seconds(rs, tmp_path):
    import json

    from cluster.tools.sim.cost_model import PROFILE_DIR

    data = json.loads((PROFILE_DIR / "cpu.json").read_text())
    data["prefill"]["seconds"] = [[2 * s for s in row] for row in data["prefill"]["seconds"]]
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(data))
    reqs = _mooncake(rs)
    base = rs.service_floor(reqs, _args(), 64)
    twice = rs.service_floor(reqs, _args(profile=str(slow)), 64)
    for q in ("p50", "p90", "mean"):
        assert twice[f"ttft_{q}_s"] == pytest.approx(2 * base[f"ttft_{q}_s"], rel=1e-3), q
    with pytest.raises(ValueError, match="no cost profile"):
        rs.service_floor(reqs, _args(profile=str(tmp_path / "missing.json")), 64)

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

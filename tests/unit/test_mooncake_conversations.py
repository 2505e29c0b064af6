"""benchmarks/mooncake_conversations.py: conversations counted by turns."""
from __future__ import annotations

from bench_scripts import load_bench_script


def test_by_turns_counts_each_class_and_the_tail():
    load_bench_script("routing_workloads")           # its imports of routing_workloads and routing_sim resolve
    load_bench_script("routing_sim")
    mc = load_bench_script("mooncake_conversations")
    assert mc.by_turns([1, 1, 2, 3, 5, 7, 1], 3) == {"1": 3, "2": 1, "3+": 3}
    assert mc.by_turns([2, 2], 2) == {"1": 0, "2+": 2}

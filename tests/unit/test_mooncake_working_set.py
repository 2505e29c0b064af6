"""benchmarks/mooncake_working_set.py: the live prefix working set and the LRU model of each policy."""
from __future__ import annotations

import json

import pytest

from bench_scripts import load_bench_script


@pytest.fixture(scope="module")
def mws():
    load_bench_script("routing_workloads")          # its import of routing_workloads resolves
    return load_bench_script("mooncake_working_set")


def prompt(*blocks: int) -> list[int]:
    """A prompt of 16-token blocks, block b made of the token b."""
    return [t for b in blocks for t in [b] * 16]


def test_a_block_is_live_from_its_computation_to_its_last_hit(mws):
    keys = [mws.block_keys(prompt(1, 2)), mws.block_keys(prompt(3)), mws.block_keys(prompt(1, 2, 4)),
            mws.block_keys(prompt(3, 5)), mws.block_keys(prompt(1, 6))]
    live = mws.live_intervals(keys, [0.0, 5.0, 10.0, 20.0, 30.0])
    k1, k2 = keys[0]
    assert live == {k1: (0.0, 30.0), k2: (0.0, 10.0), keys[1][0]: (5.0, 20.0)}    # 4, 5, 6 never reused
    assert mws.working_set(live, 40.0) == {"peak": 3, "mean": round((30 + 10 + 15) / 40, 1)}


def test_blocks_chain_on_their_prefix(mws):
    assert mws.block_keys(prompt(1, 2))[1] != mws.block_keys(prompt(3, 2))[1]
    assert len(mws.block_keys(prompt(1, 2)[:31])) == 1                            # full blocks only


def test_first_turns_go_to_the_lightest_worker_and_conversations_stay(mws):
    assert mws.sticky_workers([0, 1, 0, 2, 1], [100, 50, 100, 10, 10], 2) == [0, 1, 0, 1, 1]


def test_round_robin_misses_a_turn_on_another_worker_and_a_small_cache_evicts(mws):
    turns = [prompt(1, 2), prompt(7, 8, 9), prompt(1, 2, 3)]
    keys, lengths = [mws.block_keys(p) for p in turns], [len(p) for p in turns]
    total = sum(lengths)
    assert mws.lru_hit_rate(keys, lengths, [0, 1, 0], 8) == pytest.approx(32 / total)    # turn 2 hits 1, 2
    assert mws.lru_hit_rate(keys, lengths, [0, 1, 1], 8) == 0.0                          # on the other worker
    assert mws.lru_hit_rate(keys, lengths, [0, 0, 0], 4) == pytest.approx(16 / total)    # 2 evicted, 1 kept
    assert mws.lru_hit_rate(keys, lengths, [0, 0, 0], 3) == 0.0


def test_the_sample_conversations_match_the_replayed_requests(mws, tmp_path):
    rows = [{"timestamp": 10 * i, "input_length": 1000 + 500 * (i // 2), "output_length": 9,
             "hash_ids": [0, 100 + i % 2] + [200 + 10 * (i % 2) + k for k in range(i // 2)]} for i in range(6)]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    spec = mws.MooncakeSample(str(path), conversations=2, block_len=16, time_scale=1.0, max_len=4096)
    assert mws.sample_conversations(spec) in ([0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0])
    assert len(mws.mooncake_dataset(spec, 1000)) == 6

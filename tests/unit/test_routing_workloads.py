"""benchmarks/routing_workloads.py: the Mooncake replay keeps whole conversations."""
from __future__ import annotations

import json
import random

import pytest

from bench_scripts import load_bench_script


@pytest.fixture(scope="module")
def rw():
    return load_bench_script("routing_workloads")


ROWS = [  # id 0 is every request's system block: it alone makes no conversation
    {"timestamp": 0, "input_length": 1000, "output_length": 9, "hash_ids": [0, 1]},
    {"timestamp": 10, "input_length": 1000, "output_length": 9, "hash_ids": [0, 2]},
    {"timestamp": 20, "input_length": 2000, "output_length": 9, "hash_ids": [0, 1, 3, 4]},
    {"timestamp": 30, "input_length": 2500, "output_length": 9, "hash_ids": [0, 1, 3, 4, 5]},
    {"timestamp": 40, "input_length": 1500, "output_length": 9, "hash_ids": [0, 2, 6]},
]


def test_requests_join_the_conversation_they_extend(rw):
    assert rw.conversations(ROWS) == [[0, 2, 3], [1, 4]]


def test_a_sample_keeps_every_turn_scaled_and_shares_prefix_tokens(rw, tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    spec = rw.MooncakeSample(str(path), conversations=1, block_len=16, time_scale=0.5, max_len=64, output_len=4)
    reqs = rw.mooncake_dataset(spec, 1000)
    assert len(reqs) in (2, 3)
    first, last = reqs[0], reqs[-1]
    assert first.arrival_s == 0 and last.arrival_s > 0
    assert all(r.output_len == 1 for r in reqs)                       # 9 * 16 / 512 rounds to 0 -> 1
    assert last.prompt_token_ids[:first.prompt_len] == first.prompt_token_ids    # the turn extends the first
    assert max(r.prompt_len for r in reqs) <= 64
    with pytest.raises(ValueError, match="--conversations must be in"):
        rw.mooncake_dataset(rw.MooncakeSample(str(path), conversations=3), 1000)


def test_min_turns_draws_only_multi_turn_conversations(rw, tmp_path):
    rows = ROWS + [{"timestamp": 50, "input_length": 1024, "output_length": 9, "hash_ids": [0, 7, 8]}]   # one turn
    assert rw.conversations(rows) == [[0, 2, 3], [1, 4], [5]]
    for seed in range(6):               # 1 (the default) draws among all, as before the option
        assert rw.pick_conversations(rows, 2, seed) == sorted(
            i for c in random.Random(seed).sample(rw.conversations(rows), 2) for i in c)
        assert rw.pick_conversations(rows, 2, seed, min_turns=2) == [0, 1, 2, 3, 4]
        assert rw.pick_conversations(rows, 1, seed, min_turns=3) == [0, 2, 3]
    with pytest.raises(ValueError, match=r"in \[1, 1\] \(the conversations of at least 3 turns\)"):
        rw.pick_conversations(rows, 2, 0, min_turns=3)
    with pytest.raises(ValueError, match="--min-turns must be >= 1"):
        rw.pick_conversations(rows, 1, 0, min_turns=0)
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    reqs = rw.mooncake_dataset(rw.MooncakeSample(str(path), conversations=1, min_turns=3, max_len=4096), 1000)
    assert len(reqs) == 3

"""pdserve bench datasets: lengths, determinism, prefix structure, trace replay, ideal hit rate."""
from __future__ import annotations

import json

import pytest

from cluster.tools.bench import datasets as ds

VOCAB = 384


def test_random_lengths_stay_in_range_and_tokens_avoid_special_ids():
    reqs = ds.random_dataset(ds.RandomSpec(100, 20, 0.5), 400, VOCAB, seed=1)
    lo, hi = ds.token_range(VOCAB)
    ins = [len(r.prompt_token_ids) for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 30
    assert min(outs) >= 10 and max(outs) <= 30
    assert all(lo <= t < hi for r in reqs for t in r.prompt_token_ids)
    assert all(r.prompt_len == len(r.prompt_token_ids) for r in reqs)


def test_random_is_seeded():
    a = ds.random_dataset(ds.RandomSpec(32, 8), 5, VOCAB, seed=3)
    b = ds.random_dataset(ds.RandomSpec(32, 8), 5, VOCAB, seed=3)
    c = ds.random_dataset(ds.RandomSpec(32, 8), 5, VOCAB, seed=4)
    assert a == b and a != c
    assert {len(r.prompt_token_ids) for r in a} == {32} and {r.output_len for r in a} == {8}


@pytest.mark.parametrize("spec", [ds.RandomSpec(0, 8), ds.RandomSpec(8, 8, 1.0), ds.RandomSpec(8, 0)])
def test_random_rejects_bad_lengths(spec):
    with pytest.raises(ValueError, match="--random"):
        ds.random_dataset(spec, 3, VOCAB, seed=0)


def test_shared_prefix_groups_share_exactly_the_system_prompt():
    spec = ds.SharedPrefixSpec(groups=3, prompts_per_group=5, system_len=40, question_len=7, output_len=4)
    reqs = ds.shared_prefix_dataset(spec, VOCAB, seed=0)
    assert len(reqs) == 15 and all(len(r.prompt_token_ids) == 47 and r.output_len == 4 for r in reqs)
    systems = [r.prompt_token_ids[:40] for r in reqs]
    assert len(set(systems)) == 3 and all(systems.count(s) == 5 for s in set(systems))
    assert len({r.prompt_token_ids for r in reqs}) == 15           # questions are unique
    firsts = [systems.index(s) for s in systems]
    assert firsts != sorted(firsts), "groups should interleave (shuffled), not arrive group by group"
    assert {r.cache_salt for r in reqs} == {""}


def test_shared_prefix_tenants_get_distinct_salts_in_turn():
    spec = ds.SharedPrefixSpec(groups=2, prompts_per_group=6, system_len=16, question_len=4, tenants=3)
    reqs = ds.shared_prefix_dataset(spec, VOCAB, seed=0)
    assert [r.cache_salt for r in reqs[:4]] == ["bench-tenant-0", "bench-tenant-1", "bench-tenant-2",
                                                "bench-tenant-0"]


def test_shared_prefix_rejects_zero_groups():
    with pytest.raises(ValueError, match="--sp-groups"):
        ds.shared_prefix_dataset(ds.SharedPrefixSpec(groups=0), VOCAB, seed=0)


def _req(ids, salt=""):
    return ds.BenchRequest(tuple(ids), 1, prompt_len=len(ids), cache_salt=salt)


def test_ideal_hit_rate_hand_computed():
    a = list(range(10, 19))                  # 9 tokens: blocks [10..13], [14..17], tail 18
    b = a[:8] + [99, 98]                     # same 2 blocks, then different
    c = [a[0], 77] + a[2:]                   # differs in block 0: nothing after it can hit
    # a: 0 cached; b: 8 cached; c: 0 cached; a again: min(8, 9-1)=8 -> 16 / (9+10+9+9)
    assert ds.ideal_prefix_hit_rate([_req(a), _req(b), _req(c), _req(a)], 4) == pytest.approx(16 / 37)


def test_ideal_hit_rate_leaves_the_last_token_and_respects_salts():
    a = list(range(10, 18))                  # exactly 2 blocks of 4
    assert ds.ideal_prefix_hit_rate([_req(a), _req(a)], 4) == pytest.approx(7 / 16)
    assert ds.ideal_prefix_hit_rate([_req(a, "t1"), _req(a, "t2")], 4) == 0.0


def test_ideal_hit_rate_of_shared_prefix_workload():
    spec = ds.SharedPrefixSpec(groups=3, prompts_per_group=4, system_len=32, question_len=5)
    reqs = ds.shared_prefix_dataset(spec, VOCAB, seed=2)
    # every prompt but a group's first reuses the 32-token system prompt (2 full blocks of 16)
    assert ds.ideal_prefix_hit_rate(reqs, 16) == pytest.approx(3 * 3 * 32 / (12 * 37))
    two_tenants = ds.shared_prefix_dataset(ds.SharedPrefixSpec(3, 4, 32, 5, tenants=2), VOCAB, seed=2)
    assert ds.ideal_prefix_hit_rate(two_tenants, 16) < ds.ideal_prefix_hit_rate(reqs, 16)


def _write_trace(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_trace_equal_hash_ids_give_equal_tokens_and_times_scale(tmp_path):
    p = _write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 1000, "output_length": 100, "hash_ids": [5, 6]},
        {"timestamp": 3000, "input_length": 1024, "output_length": 512, "hash_ids": [5, 7]},
        {"timestamp": 4000, "input_length": 300, "output_length": 10, "hash_ids": [6]},
    ])
    reqs = ds.trace_dataset(p, 10, ds.TraceSpec(block_len=512, time_scale=0.5), VOCAB)
    assert [r.arrival_s for r in reqs] == [0.0, 1.0, 1.5]
    assert [len(r.prompt_token_ids) for r in reqs] == [1000, 1024, 300]
    assert reqs[0].prompt_token_ids[:512] == reqs[1].prompt_token_ids[:512]     # hash 5 at block 0
    assert reqs[0].prompt_token_ids[512:1000] != reqs[1].prompt_token_ids[512:1000]
    assert reqs[2].prompt_token_ids == reqs[0].prompt_token_ids[512:812]         # hash 6
    assert [r.output_len for r in reqs] == [100, 512, 10]


def test_trace_block_len_scales_lengths_and_caps_apply(tmp_path):
    p = _write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1024, "output_length": 256, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 2048, "output_length": 64, "hash_ids": [1, 2, 3, 4]}])
    reqs = ds.trace_dataset(p, 10, ds.TraceSpec(block_len=16, max_len=40, max_output_len=5), VOCAB)
    assert [len(r.prompt_token_ids) for r in reqs] == [32, 40]
    assert reqs[1].prompt_token_ids[:32] == reqs[0].prompt_token_ids
    assert [r.output_len for r in reqs] == [5, 2]
    assert ds.hash_block_tokens(1, 16, VOCAB) == reqs[0].prompt_token_ids[:16]
    assert len(ds.trace_dataset(p, 1, ds.TraceSpec(block_len=16), VOCAB)) == 1


def test_trace_bad_row_names_the_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        ds.trace_dataset(p, 10, ds.TraceSpec(), VOCAB)
    with pytest.raises(ValueError, match="--trace-time-scale"):
        ds.trace_dataset(p, 10, ds.TraceSpec(time_scale=0), VOCAB)


def test_sharegpt_takes_first_turns_and_filters(tmp_path):
    conv = lambda q, a: {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
    data = [conv("one two three four five", "a b c d e f"), conv("too short", "a b c d e"),
            conv("w x y z", "1 2 3 4 5 6 7 8 9 10"), {"conversations": [{"from": "human", "value": "x"}]}]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(data))
    reqs = ds.sharegpt_dataset(p, 10, str.split, seed=0)
    assert sorted((r.prompt, r.prompt_len, r.output_len) for r in reqs) == [
        ("one two three four five", 5, 6), ("w x y z", 4, 10)]
    assert all(r.prompt_token_ids is None for r in reqs)
    assert len(ds.sharegpt_dataset(p, 1, str.split, seed=0)) == 1
    assert [r.prompt for r in ds.sharegpt_dataset(p, 10, str.split, seed=0, max_len=12)] == ["one two three four five"]
    p.write_text("{}")
    with pytest.raises(ValueError, match="JSON list"):
        ds.sharegpt_dataset(p, 10, str.split, seed=0)

"""Tiers end to end: a device pool deliberately too small for the working set,
with the host (and disk) tier on, gives greedy outputs identical to an
unconstrained run and to transformers, with a higher prefix hit rate than
without the tier; preemption by swap resumes exactly; the disk tier stays
within its bound."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tiny_models import hf_greedy, load_hf_model

MAX_NEW = 10
SESSIONS, ROUNDS = 6, 3
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
COMMON = dict(max_model_len=128, max_num_seqs=6)


def _workload(vocab: int):
    """Sessions with their own 40-token history; each turn re-sends it plus a
    few new tokens, so their prefixes come back after the others' turns."""
    rng = random.Random(7)
    history = [[rng.randrange(3, vocab) for _ in range(40)] for _ in range(SESSIONS)]
    turns = [history[s] + [rng.randrange(3, vocab) for _ in range(3 + r)]
             for r in range(ROUNDS) for s in range(SESSIONS)]
    burst = [history[s] + [rng.randrange(3, vocab) for _ in range(8)] for s in range(SESSIONS)]
    return turns, burst


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    hf = load_hf_model(tiny_llama_dir)
    turns, burst = _workload(hf.config.vocab_size)
    return (turns, burst, [hf_greedy(hf, p, MAX_NEW) for p in turns],
            [hf_greedy(hf, p, LONG.max_tokens) for p in burst])


def _run(model_dir, turns, burst, **kwargs):
    llm = LLM(str(model_dir), **COMMON, **kwargs)
    outs = []
    for prompt in turns:                          # one session at a time: sessions idle in between
        outs.append(llm.generate([prompt], GREEDY)[0].token_ids)
        llm.engine.check_integrity()
    burst_outs = [o.token_ids for o in llm.generate(burst, LONG)]    # all at once: preemption
    llm.engine.check_integrity()
    return llm, outs, burst_outs


@pytest.mark.parametrize("kwargs", [
    dict(num_host_kv_blocks=64),
    dict(num_host_kv_blocks=64, preemption_mode="swap"),
    dict(num_host_kv_blocks=64, preemption_mode="recompute"),
], ids=["host-auto", "host-swap", "host-recompute"])
def test_small_device_pool_with_host_tier_matches_transformers(tiny_llama_dir, reference, kwargs):
    turns, burst, expected, expected_burst = reference
    llm, outs, burst_outs = _run(tiny_llama_dir, turns, burst, num_kv_blocks=12, **kwargs)
    assert outs == expected
    assert burst_outs == expected_burst
    stats = llm.engine.stats()
    assert stats.kv_page_outs > 0 and stats.kv_page_ins > 0
    assert stats.preemptions > 0, "the burst was meant to overflow the device pool"
    if kwargs.get("preemption_mode") == "swap":
        assert stats.swap_preemptions == stats.preemptions and stats.kv_bytes_moved > 0
    if kwargs.get("preemption_mode") == "recompute":
        assert stats.swap_preemptions == 0
    assert stats.kv_blocks_used == 0 and stats.kv_host_blocks_used <= stats.kv_host_blocks_total


def test_host_tier_raises_the_prefix_hit_rate_and_matches_an_unconstrained_run(tiny_llama_dir, reference):
    turns, burst, expected, _ = reference
    big, big_outs, _ = _run(tiny_llama_dir, turns, [], num_kv_blocks=256)
    small, small_outs, _ = _run(tiny_llama_dir, turns, [], num_kv_blocks=12)
    tiered, tiered_outs, _ = _run(tiny_llama_dir, turns, [], num_kv_blocks=12, num_host_kv_blocks=64)
    assert big_outs == small_outs == tiered_outs == expected

    def hit_rate(llm):
        s = llm.engine.stats()
        return s.prefix_hit_tokens / s.prefix_queried_tokens

    assert hit_rate(tiered) > hit_rate(small)
    assert hit_rate(tiered) == hit_rate(big)      # every idle session's history came back from host


def test_disk_tier_below_a_tiny_host_tier_stays_within_its_bound(tiny_llama_dir, reference, tmp_path):
    turns, burst, expected, expected_burst = reference
    bound = 10 * 12288 + 100          # ten blocks of the tiny model (12 KiB each) and change
    llm, outs, burst_outs = _run(tiny_llama_dir, turns, burst, num_kv_blocks=12, num_host_kv_blocks=4,
                                 disk_kv_dir=str(tmp_path), disk_kv_bytes=bound)
    assert outs == expected and burst_outs == expected_burst
    stats = llm.engine.stats()
    assert stats.kv_disk_blocks_total == 10 and stats.kv_disk_blocks_used > 0
    disk = llm.engine.runner.tiers.disk
    assert disk.bytes_per_block == 12288
    assert sum(f.stat().st_size for f in tmp_path.iterdir()) <= bound
    llm.engine.runner.tiers.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantized_blocks_page_swap_and_spill_to_disk_exactly(tiny_llama_dir, reference, tmp_path, kv):
    """A quantized pool's blocks (codes and in-block scales) move through host, swap and disk
    byte for byte: a constrained run gives the same tokens as an unconstrained quantized run."""
    turns, burst, _, _ = reference
    _, want, want_burst = _run(tiny_llama_dir, turns, burst, num_kv_blocks=256, kv_cache_dtype=kv)
    per_block = 16 * 2 * 3 * 2 * (16 + 2)         # tiny Llama int8 / fp8 block: 3456 bytes, not 12288
    for kwargs in (dict(num_host_kv_blocks=64, preemption_mode="swap"),
                   dict(num_host_kv_blocks=4, disk_kv_dir=str(tmp_path), disk_kv_bytes=10 * per_block)):
        llm, outs, burst_outs = _run(tiny_llama_dir, turns, burst, num_kv_blocks=12, kv_cache_dtype=kv, **kwargs)
        assert outs == want and burst_outs == want_burst, kwargs
        stats = llm.engine.stats()
        assert stats.kv_page_outs > 0 and stats.kv_page_ins > 0 and stats.preemptions > 0
        assert stats.kv_bytes_moved % per_block == 0
        if "disk_kv_dir" in kwargs:
            assert llm.engine.runner.tiers.disk.bytes_per_block == per_block
            assert stats.kv_disk_blocks_total == 10 and stats.kv_disk_blocks_used > 0
        else:
            assert stats.swap_preemptions == stats.preemptions
        llm.engine.runner.tiers.close()

"""engine.LLM greedy outputs equal transformers `generate`, token for token,
whatever the batching, chunking, prefix caching or preemption."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tiny_models import hf_greedy, load_hf_model

MAX_NEW = 12


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]          # 2.5 blocks of 16
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 7, 16, 33, 70, 95)]
    prompts += [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (0, 5, 24)]
    prompts.append(shared[:32])                                      # exactly two full blocks
    return prompts


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    hf = load_hf_model(tiny_llama_dir)
    prompts = _prompts(hf.config.vocab_size)
    return prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kwargs", [
    dict(),                                                       # prefix caching on, big budget
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=7),                               # chunked prefill in small chunks
    dict(max_num_batched_tokens=23, max_num_seqs=3),
    dict(num_kv_blocks=14, max_num_seqs=8),                       # small pool: forces preemption
], ids=["prefix-cache", "no-prefix-cache", "chunk-7", "chunk-23-seqs-3", "preempt"])
def test_greedy_matches_transformers(tiny_llama_dir, reference, kwargs):
    prompts, expected = reference
    opts = dict(num_kv_blocks=128, max_model_len=128) | kwargs
    llm = LLM(str(tiny_llama_dir), **opts)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out, ref in zip(prompts, outs, expected):
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"
    llm.engine.check_integrity()
    stats = llm.engine.stats()
    assert stats.kv_blocks_used == 0
    if "num_kv_blocks" in kwargs:
        assert stats.preemptions > 0, "the small pool was meant to force preemption"
    if kwargs == {}:
        # the second pass over the same prompts hits the prefix cache and still matches
        again = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in again] == expected
        assert sum(o.num_cached_tokens for o in again) > 0


def test_qwen2_greedy_matches_transformers(tiny_qwen2_dir):
    hf = load_hf_model(tiny_qwen2_dir)
    prompts = _prompts(hf.config.vocab_size, seed=1)[:6]
    llm = LLM(str(tiny_qwen2_dir), num_kv_blocks=96, max_model_len=128, max_num_batched_tokens=19)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def test_n_samples_share_prompt_blocks_and_reproduce(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=128)
    params = SamplingParams(max_tokens=10, temperature=1.0, n=4, seed=7, ignore_eos=True)
    a = llm.generate([list(range(3, 40))], params)[0]
    b = llm.generate([list(range(3, 40))], params)[0]
    assert len(a.outputs) == 4
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1, "different samples should differ"
    greedy = llm.generate([list(range(3, 40))], SamplingParams(max_tokens=10, temperature=0, n=3,
                                                                 ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    llm.engine.check_integrity()
    assert llm.engine.stats().kv_blocks_used == 0


def test_stop_strings_and_text(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=128)
    full = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=20, temperature=0,
                                                                 ignore_eos=True))[0]
    assert full.text == llm.tokenizer.decode(full.token_ids)
    stop = full.text[3:6]
    if not stop.strip() or "\ufffd" in stop:
        pytest.skip("random model produced no usable stop string")
    cut = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=20, temperature=0,
                                                                ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop, (full.text, stop, cut.text)
    assert cut.text == full.text[:full.text.index(stop)]


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), "empty"),
    ([5] * 200, SamplingParams(max_tokens=4), "max_model_len"),
    ([5, 6], SamplingParams(max_tokens=400), "max_model_len"),
    ([5, 10**6], SamplingParams(), "vocab"),
])
def test_bad_input_is_rejected_and_harms_nothing(tiny_llama_dir, prompt, params, match):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=128)
    good = list(range(3, 20))
    with pytest.raises(ValueError, match=match):
        llm.generate([good, prompt], params)
    out = llm.generate([good], GREEDY)[0]
    assert len(out.token_ids) == MAX_NEW
    llm.engine.check_integrity()
    assert llm.engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)

"""The default model, end to end: LLM() with no arguments loads SmolLM2-135M-Instruct."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tiny_models import hf_greedy, hf_llama_from_state

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, kv_cache_memory_bytes=64 << 20)


def test_chat_answers_the_obvious(llm):
    out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                   SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_greedy_equals_transformers_on_the_same_weights(llm):
    from engine.loader.load import load_model_source

    cfg, state = load_model_source(None)
    hf = hf_llama_from_state(cfg, state)
    prompts = [llm.tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 16)


def test_int8_kv_cache_still_answers_the_obvious():
    """Quantized KV (int8, scales per token and head): the simple questions still come out right."""
    llm = LLM(max_model_len=512, kv_cache_memory_bytes=16 << 20, kv_cache_dtype="int8")
    assert llm.engine.runner.kv_pool.tensor.dtype.itemsize == 1
    outs = llm.chat([[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "user", "content": "What is 2 + 2?"}]],
                    SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in outs[0].text
    assert "4" in outs[1].text

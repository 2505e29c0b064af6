"""The engine on a model whose embedding has more rows (384) than its tokenizer has tokens (320):
prompts may hold any id the model accepts, and the first token a prefill node hands off (given at
once, or after a reservation made ahead of it) is the model's own output, not checked against the
tokenizer. The cluster-level behaviour: tests/e2e/test_padded_vocab.py."""
from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tiny_models import make_tiny_model

TOKENS, ROWS = 320, 384


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("padded"), "qwen2", vocab_size=TOKENS, padded_vocab_size=ROWS,
                           tie_word_embeddings=True, max_position_embeddings=256, num_layers=1)
    e = LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(num_blocks=64)))
    assert (e.vocab_size, e.tokenizer.vocab_size) == (ROWS, TOKENS)
    return e


def test_prompts_may_hold_any_id_the_model_accepts(engine):
    engine.add_request("user-ids", [5, TOKENS, ROWS - 1, 7], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=f"token id {ROWS} at position 1 is out of range.*0..{ROWS - 1}"):
        engine.add_request("too-big", [5, ROWS], SamplingParams(max_tokens=1))
    engine.abort_request("user-ids")


def test_handed_off_first_tokens_past_the_tokenizer_are_accepted(engine):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    assert engine.add_remote_request("at-once", [5, 6, 7], params, first_token=TOKENS + 30) is not None
    assert engine.add_remote_request("ahead", [5, 6, 8], params) is not None
    assert engine.remote_kv_ready("ahead", first_token=TOKENS + 31)
    with pytest.raises(ValueError, match="out of range"):
        engine.add_remote_request("bad", [5, 6, 9], params, first_token=ROWS)
    for rid in ("at-once", "ahead"):
        engine.abort_request(rid)

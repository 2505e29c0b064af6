"""The real SmolLM2 GGUF: config from metadata, dequantized weights in HF layout."""
from __future__ import annotations

import numpy as np
import pytest

from tiny_models import hf_llama_from_state
import torch

from engine.loader import default_model_path, load_gguf
from engine.loader.gguf_weights import hf_name, unpermute_rotary

# "The capital of France is" with SmolLM2's BPE (derived once from the GGUF vocab + merges)
PROMPT = [504, 3575, 282, 4649, 314]
PARIS = 7042   # " Paris"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Q/K rows (reimplemented for the test)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@pytest.mark.parametrize("n_head,rows,cols", [(9, 576, 8), (3, 192, 5), (4, 64, 0)])
def test_unpermute_inverts_llama_cpp_permute(n_head, rows, cols):
    w = np.random.default_rng(0).standard_normal((rows, cols) if cols else (rows,))
    assert np.array_equal(unpermute_rotary(_llama_cpp_permute(w, n_head), n_head), w)
    assert not np.array_equal(_llama_cpp_permute(w, n_head), w)


def test_tensor_names_map_to_hf():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.0.something_new.weight") is None


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = default_model_path()
    except ValueError as e:
        pytest.fail(str(e))
    return load_gguf(path)


def _hf_from(cfg, state):
    model = hf_llama_from_state(cfg, state)
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])   # tied
    return model


@pytest.mark.smollm2
def test_smollm2_config_from_metadata(smollm2):
    cfg, state = smollm2
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 9, 3, 64, 576, 49152)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in state
    assert cfg.rms_norm_eps == 1e-5 and cfg.eos_token_ids == (2,)
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(t.dtype == torch.float32 for t in state.values())


@pytest.mark.smollm2
def test_smollm2_ours_matches_hf_and_knows_paris(smollm2):
    from _runner_helpers import request, sched_seq, step
    from engine.config import CacheConfig
    from engine.model_runner import ModelRunner

    cfg, state = smollm2
    hf = _hf_from(cfg, state)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1]
    assert int(ref.argmax()) == PARIS          # only right if Q/K rows were un-permuted
    runner = ModelRunner(cfg, state, cache_config=CacheConfig(block_size=16, num_blocks=8),
                         max_model_len=128, dtype="float32")
    req = request("fr", PROMPT)
    ours = step(runner, [sched_seq(req, len(PROMPT), [3, 1])])[0]
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
    # a few greedy decode steps agree with HF token for token
    for _ in range(4):
        req.append_output_token(int(ours.argmax()))
        ours = step(runner, [sched_seq(req, 1, [3, 1])])[0]
    with torch.no_grad():
        ref_all = hf(torch.tensor([req.all_token_ids])).logits[0, -1]
    torch.testing.assert_close(ours, ref_all, atol=1e-3, rtol=0)

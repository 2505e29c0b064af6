"""Read a GGUF file (engine/loader/gguf_file.py; the ``gguf`` package dequantizes):
config from its metadata, every tensor dequantized to float32 and renamed to Hugging Face names.

llama.cpp's converter permutes the rows of Q and K of Llama-style models so
that its rotary kernel can rotate adjacent pairs; HF rotates the two halves of
each head. We undo that permutation so the weights match HF's layout.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.loader.gguf_file import GGUFFile

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2")
# archs whose converter applied the rotary Q/K row permutation
_PERMUTED_ARCHS = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _f32(x) -> float:
    """GGUF stores floats as float32: 9.9999997e-06 -> 1e-05."""
    return float(f"{float(x):.7g}")


def hf_name(gguf_name: str) -> str | None:
    """HF tensor name for a llama.cpp tensor name (None: not a weight we use)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute(w, n_head)`` on Q/K rows (weight or bias)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_model_config(reader: GGUFFile, *, name: str = "model") -> ModelConfig:
    arch = reader.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHS)}")
    if reader.fields.get(f"{arch}.rope.scaling.type") is not None and \
            reader.get(f"{arch}.rope.scaling.type") not in ("none", "linear"):
        raise ValueError("this GGUF uses a rope scaling pdserve does not read from GGUF; "
                         "load the Hugging Face directory instead")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("this GGUF carries llama3 rope frequency factors (rope_freqs.weight), which "
                         "pdserve does not read from GGUF; load the Hugging Face directory instead")
    hidden = int(reader.get(f"{arch}.embedding_length"))
    heads = int(reader.get(f"{arch}.attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = reader.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"])
    scaling = None
    if reader.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = (("factor", float(reader.get(f"{arch}.rope.scaling.factor"))),
                   ("rope_type", "linear"))
    eos = [reader.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(reader.get(f"{arch}.feed_forward_length")),
        num_layers=int(reader.get(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(reader.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(reader.get(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=_f32(reader.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(reader.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(reader.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=f"blk.0.attn_q.bias" in tensor_names,
        bos_token_id=reader.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        name=name,
    )


def _dequantize(tensor) -> np.ndarray:
    from gguf import quants

    arr = quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))   # GGUF lists dims innermost first
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, float32 state dict in HF naming) of a GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {path} does not exist")
    reader = GGUFFile(path)
    config = gguf_model_config(reader, name=path.stem)
    permuted = config.architecture in _PERMUTED_ARCHS
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ValueError(f"unexpected tensor {t.name!r} in {path.name}: not a Llama-family GGUF?")
        w = _dequantize(t)
        if permuted and ".q_proj." in name:
            w = unpermute_rotary(w, config.num_heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_rotary(w, config.num_kv_heads)
        w = np.ascontiguousarray(w)
        state[name] = torch.from_numpy(w if w.flags.writeable else w.copy())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return config, state

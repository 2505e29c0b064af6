"""Hugging Face ``config.json`` -> :class:`engine.config.ModelConfig`."""
from __future__ import annotations

import json
from pathlib import Path

from engine.config import ModelConfig

# HF architecture name -> our architecture tag
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _rope(cfg: dict) -> tuple[float, tuple[tuple[str, object], ...] | None]:
    """(rope_theta, rope_scaling items) from either the transformers>=5
    ``rope_parameters`` dict or the older ``rope_theta`` + ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or {}) or params
    scaling.pop("rope_theta", None)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}. Use a model without it or add it to "
                         "engine/model/rope.py")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    return theta, tuple(sorted(scaling.items()))


def _eos_ids(*values) -> tuple[int, ...]:
    out: list[int] = []
    for v in values:
        for t in (v if isinstance(v, list) else [v]):
            if isinstance(t, int) and t not in out:
                out.append(t)
    return tuple(out)


def model_config_from_hf(cfg: dict, *, name: str = "model",
                         generation_config: dict | None = None) -> ModelConfig:
    """Translate an HF config dict; raise ValueError for what we cannot run."""
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {archs!r} in config.json; pdserve runs "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only silu / SwiGLU)")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported: use a checkpoint without MLP biases")
    if arch == "qwen2" and cfg.get("use_sliding_window"):
        raise ValueError("Qwen2 use_sliding_window=true is not supported; set it to false")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if arch == "mistral" and window:
        # no sliding-window attention here: within the window it is plain causal attention
        max_pos = min(max_pos, int(window))
    theta, scaling = _rope(cfg)
    gen = generation_config or {}
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id"), gen.get("eos_token_id")),
        name=name,
    )


def load_hf_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` when present)."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json: give a Hugging Face model directory "
                         "or a .gguf file")
    cfg = json.loads(path.read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return model_config_from_hf(cfg, name=model_dir.name, generation_config=gen)

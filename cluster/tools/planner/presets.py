"""Named models with published architectures, for planning without weights.

Figures are the fields of each model's Hugging Face config.json
(num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size,
head_dim or hidden_size / num_attention_heads, max_position_embeddings) and
the parameter count the model card / Hub page states. Default weight bytes
are parameters x 2 (the checkpoints ship in bf16); override with --weights.
"""
from __future__ import annotations

from cluster.tools.planner.model_spec import ModelSpec


def _preset(name: str, layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int,
            context: int, params: float) -> ModelSpec:
    n = int(params)
    return ModelSpec(name=name, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, hidden_size=hidden, max_context=context,
                     weight_bytes=2 * n, source="preset", num_params=n)


def all_presets() -> tuple[ModelSpec, ...]:
    return (
        # meta-llama/Meta-Llama-3-8B config.json; 8.03B params (Hub page).
        _preset("Llama-3-8B", 32, 32, 8, 128, 4096, 8192, 8.03e9),
        # meta-llama/Meta-Llama-3-70B config.json; 70.6B params (Hub page).
        _preset("Llama-3-70B", 80, 64, 8, 128, 8192, 8192, 70.6e9),
        # meta-llama/Llama-3.1-405B config.json (126 layers, 128 heads, 8 KV heads,
        # hidden 16384, 128K context); 405.9B params (Hub page, "406B").
        _preset("Llama-3.1-405B", 126, 128, 8, 128, 16384, 131072, 405.9e9),
        # mistralai/Mistral-7B-v0.1 config.json (32k positions, 4k sliding window
        # not modelled: the planner assumes full attention); 7.24B params.
        _preset("Mistral-7B", 32, 32, 8, 128, 4096, 32768, 7.24e9),
        # Qwen/Qwen2-7B config.json (28 layers, 28 heads, 4 KV heads, hidden 3584); 7.62B params.
        _preset("Qwen2-7B", 28, 28, 4, 128, 3584, 32768, 7.62e9),
        # Qwen/Qwen2-72B config.json (80 layers, 64 heads, 8 KV heads, hidden 8192); 72.7B params.
        _preset("Qwen2-72B", 80, 64, 8, 128, 8192, 32768, 72.7e9),
        # HuggingFaceTB/SmolLM2-135M config.json (30 layers, 9 heads, 3 KV heads,
        # hidden 576, head dim 64, 8192 positions); 134.5M params.
        _preset("SmolLM2-135M", 30, 9, 3, 64, 576, 8192, 134.5e6),
        # HuggingFaceTB/SmolLM2-1.7B config.json (24 layers, 32 heads, 32 KV heads = plain MHA,
        # hidden 2048, 8192 positions); 1.71B params.
        _preset("SmolLM2-1.7B", 24, 32, 32, 64, 2048, 8192, 1.71e9),
    )


def preset_names() -> list[str]:
    return [p.name for p in all_presets()]


def find_preset(name: str) -> ModelSpec | None:
    """Case-insensitive lookup; None when `name` is not a preset."""
    wanted = name.strip().lower()
    return next((p for p in all_presets() if p.name.lower() == wanted), None)


def get_preset(name: str) -> ModelSpec:
    preset = find_preset(name)
    if preset is None:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(preset_names())}")
    return preset

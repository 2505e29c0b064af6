"""One rank's weights: only its slices are read from a Hugging Face directory (safetensors
slices, so a rank never holds the whole model); a GGUF file is loaded whole, then sliced."""
from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.parallel.sharding import ShardLayout, shard_state_dict, slice_for, take


def load_rank_weights(model: str | Path, tp: int,
                      rank: int) -> tuple[ModelConfig, ShardLayout, dict[str, torch.Tensor]]:
    """(the whole model's config, rank ``rank``'s layout, its HF-named slices) of ``model``."""
    from engine.loader.hf_config import load_hf_config
    from engine.loader.hf_weights import safetensors_files
    from engine.loader.load import load_model_source, resolve_model_path

    path = resolve_model_path(str(model))
    if not path.is_dir():
        config, full = load_model_source(path)
        layout = ShardLayout.of(config, tp, rank)
        return config, layout, shard_state_dict(full, config, layout)
    from safetensors import safe_open

    config = load_hf_config(path)
    layout = ShardLayout.of(config, tp, rank)
    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                lazy = st.get_slice(name)
                sl = slice_for(name, config, layout)
                state[name] = take(lazy, sl, lazy.get_shape()[sl.dim] if sl else 0)
    return config, layout, state

"""Load ``*.safetensors`` (single or sharded) from an HF directory, HF names kept."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}; convert the checkpoint with "
                         "save_pretrained(safe_serialization=True)")
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"shards listed in the index are missing: {[str(m) for m in missing]}")
    return files


def load_hf_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """State dict in HF naming (``model.layers.0.self_attn.q_proj.weight``, ...)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        state.update(load_file(str(f)))
    return state

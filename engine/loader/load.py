"""One entry point: a model path (HF directory or .gguf file) -> config + weights."""
from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from engine.loader.gguf_weights import load_gguf
from engine.loader.hf_config import load_hf_config
from engine.loader.hf_weights import load_hf_weights


def resolve_model_path(path: str | Path | None) -> Path:
    """None or the default model's name -> the installed SmolLM2 GGUF."""
    if path is None or str(path) in (DEFAULT_MODEL_NAME, "default"):
        return default_model_path()
    return Path(path)


def load_model_source(path: str | Path | None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, state dict in HF naming) from an HF directory or a .gguf file."""
    p = resolve_model_path(path)
    if p.is_dir():
        return load_hf_config(p), load_hf_weights(p)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p)
    raise ValueError(f"model {str(path)!r} is neither a Hugging Face directory (config.json + "
                     "*.safetensors) nor a .gguf file")

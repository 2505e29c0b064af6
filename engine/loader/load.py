"""One entry point: a model path (HF directory or .gguf file) -> config + weights."""
from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from engine.loader.gguf_weights import gguf_model_config, load_gguf
from engine.loader.hf_cache import cached_snapshot, looks_like_model_id
from engine.loader.hf_config import load_hf_config
from engine.loader.hf_weights import load_hf_weights


def resolve_model_path(path: str | Path | None) -> Path:
    """None or the default model's name -> the installed SmolLM2 GGUF; an existing path ->
    itself; a Hugging Face model id (``org/name``) -> its snapshot in the local HF cache."""
    if path is None or str(path) in (DEFAULT_MODEL_NAME, "default", ""):
        return default_model_path()
    p = Path(path)
    if not p.exists() and looks_like_model_id(str(path)):
        return cached_snapshot(str(path))
    return p


def served_name(path: str | Path | None) -> str:
    """The name a user types for this model: the default model's name, an HF model id as
    given, else the directory's name or the .gguf file's name without its extension."""
    if path is None or str(path) in (DEFAULT_MODEL_NAME, "default", ""):
        return DEFAULT_MODEL_NAME
    p = Path(path)
    if not p.exists() and looks_like_model_id(str(path)):
        return str(path)
    p = p.resolve()
    return p.stem if p.suffix == ".gguf" else p.name


def load_model_config(path: str | Path | None) -> ModelConfig:
    """The model's ModelConfig without its weights (a GGUF's metadata is memory-mapped)."""
    p = resolve_model_path(path)
    if p.is_dir():
        return load_hf_config(p)
    if p.is_file() and p.suffix == ".gguf":
        from engine.loader.gguf_file import GGUFFile
        return gguf_model_config(GGUFFile(p), name=p.stem)
    raise ValueError(f"model {str(path)!r} is neither a Hugging Face directory (config.json + "
                     "*.safetensors) nor a .gguf file")


def load_model_source(path: str | Path | None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, state dict in HF naming) from an HF directory or a .gguf file."""
    p = resolve_model_path(path)
    if p.is_dir():
        return load_hf_config(p), load_hf_weights(p)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p)
    raise ValueError(f"model {str(path)!r} is neither a Hugging Face directory (config.json + "
                     "*.safetensors) nor a .gguf file")

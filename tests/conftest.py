import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# No implicit ray.init(): a background task that calls Ray after a test cluster's
# ray.shutdown() would otherwise start a default cluster from the harness's loop thread;
# that cluster dies when the thread exits (PR_SET_PDEATHSIG), yet ray.is_initialized()
# stays True, so the next test's cluster "starts" on a dead GCS and the driver exits
# after 60 s (a CI run failed so). Read by Ray at import: set before any test imports it.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_hf(tiny_llama_dir):
    """transformers' model on the tiny Llama's weights: the greedy reference."""
    from tiny_models import load_hf_model
    return load_hf_model(tiny_llama_dir)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tie_word_embeddings=True)


def pytest_sessionfinish(session, exitstatus):
    """Safety net: no test bed of this run outlives it (each test removes its own; a
    crashed one is swept here, and beds of dead runs by the next TestBed.up)."""
    if os.geteuid() != 0:
        return
    try:
        from cluster.tools.testbed.bed import list_beds
    except Exception:
        return
    for bed in list_beds():
        if bed.owner_pid == os.getpid():
            print(f"\ntest bed {bed.run_id} was left behind by a test: removing it")
            bed.down()

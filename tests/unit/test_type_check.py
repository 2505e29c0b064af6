"""mypy over the engine, the transfer layer, the workers and the router is clean.

Settings live in pyproject.toml's [tool.mypy] (Python 3.11, bodies of
unannotated functions checked, third-party modules without type information
listed there). Run by hand: ``python -m mypy engine kvtransfer prefill_worker
decode_worker cluster/router`` (plus ``worker_api`` once it exists).

mypy's incremental cache is kept outside the checkout (``$PDSERVE_MYPY_CACHE_DIR``, else
``~/.cache/pdserve/mypy``, as the C++ kernels' build cache), so a fresh clone does not analyse
torch's stubs again: ~85 s cold on a 2-core host, ~3 s warm. mypy checks each cached module
against its source, so a cache from another checkout is only reused where the files agree.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("engine", "kvtransfer", "prefill_worker", "decode_worker", "worker_api", "cluster/router")


def checked_paths() -> list[str]:
    """The checked packages this tree has (worker_api is added with the shared worker base)."""
    return [p for p in CHECKED if (ROOT / p).is_dir()]


@pytest.mark.slow
def test_mypy_is_clean():
    paths = checked_paths()
    assert {"engine", "kvtransfer", "cluster/router"} <= set(paths)
    cache = os.environ.get("PDSERVE_MYPY_CACHE_DIR") or str(Path.home() / ".cache" / "pdserve" / "mypy")
    res = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", cache, *paths], cwd=ROOT,
                         capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, f"mypy {' '.join(paths)} (exit {res.returncode}):\n{res.stdout}{res.stderr}"

"""Load a benchmarks/ script as a module in a test (benchmarks/ is no package)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_bench_script(name: str) -> ModuleType:
    """benchmarks/<name>.py, registered in sys.modules (its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"no benchmarks/{name}.py"
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod

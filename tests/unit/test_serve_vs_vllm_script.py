"""benchmarks/serve_vs_vllm.py and vs_vllm.py without a vLLM: one line saying so, exit 0; a wrong
path: a clear error. (The side-by-side runs need a vLLM venv and minutes: docs/benchmarks.md records
them.)"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [ROOT / "benchmarks" / "serve_vs_vllm.py", ROOT / "benchmarks" / "vs_vllm.py"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_without_vllm_it_skips_with_one_line(script):
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    (line,) = run.stdout.splitlines()
    assert "--vllm-python" in json.loads(line)["skipped"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_vllm_python_that_does_not_exist_is_refused(tmp_path, script):
    run = subprocess.run([sys.executable, str(script), "--vllm-python", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "is not a file" in run.stderr

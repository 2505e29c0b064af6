"""benchmarks/vs_vllm.py without a vLLM: one line saying so, exit 0; a wrong path or a single
round: a clear error. (The side-by-side run needs a vLLM venv and many minutes:
docs/benchmarks.md records one.)"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vs_vllm.py"


def test_without_vllm_it_skips_with_one_line():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    (line,) = run.stdout.splitlines()
    assert "--vllm-python" in json.loads(line)["skipped"]


def test_a_vllm_python_that_does_not_exist_is_refused(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--vllm-python", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "is not a file" in run.stderr


def test_one_round_is_refused():
    run = subprocess.run([sys.executable, str(SCRIPT), "--vllm-python", sys.executable, "--rounds", "1"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "at least 2" in run.stderr

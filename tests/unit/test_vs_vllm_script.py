"""benchmarks/vs_vllm.py: a single round is refused with a clear error (the checks it shares with
serve_vs_vllm.py, no vLLM and a wrong path, are in test_serve_vs_vllm_script.py)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vs_vllm.py"


def test_one_round_is_refused():
    run = subprocess.run([sys.executable, str(SCRIPT), "--vllm-python", sys.executable, "--rounds", "1"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "at least 2" in run.stderr

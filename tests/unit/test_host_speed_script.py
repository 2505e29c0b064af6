"""benchmarks/host_speed.py: the summary of window rates, and one short real run."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "host_speed.py"


def _module():
    spec = importlib.util.spec_from_file_location("host_speed", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_of_window_rates():
    s = _module().summarise([90.0, 100.0, 110.0, 100.0])
    assert s["windows"] == 4 and s["median"] == 100.0 and s["min"] == 90.0 and s["max"] == 110.0
    assert s["spread"] == pytest.approx(0.2)
    assert s["cv"] == pytest.approx(0.0707, abs=1e-4)        # population sd 7.07 over mean 100
    with pytest.raises(ValueError, match="raise --seconds above --window"):
        _module().summarise([])


def test_a_short_run_prints_one_json_line():
    out = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "0.6", "--window", "0.2", "--procs", "1",
                          "--kinds", "python"], capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.strip().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert d["bench"] == "host_speed" and "matmul" not in d
    assert d["python"]["all"]["windows"] >= 2 and d["python"]["all"]["min"] > 0
    bad = subprocess.run([sys.executable, str(SCRIPT), "--kinds", "gpu"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--kinds takes matmul and/or python" in bad.stderr

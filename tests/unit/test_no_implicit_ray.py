"""pdserve never lets Ray start a cluster implicitly: a stray Ray call after shutdown
raises instead of starting a default local cluster from whatever thread made it (such a
cluster dies with that thread, while ray.is_initialized() stays True)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import contextlib
from cluster.cli import main
with contextlib.suppress(SystemExit):
    main(["plan", "--help"])
import ray
try:
    ray.put(1)
    print("started", ray.is_initialized())
except Exception as e:
    print("raised", type(e).__name__, ray.is_initialized())
"""


def test_the_pdserve_entry_point_turns_ray_auto_init_off():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_AUTO_CONNECT"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "raised RaySystemError False", out.stdout[-2000:]


def test_the_test_session_runs_without_ray_auto_init():
    from ray._private import auto_init_hook

    assert auto_init_hook.enable_auto_connect is False

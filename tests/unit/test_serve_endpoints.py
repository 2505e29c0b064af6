"""The multi-host test bed reads `pdserve serve`'s endpoints from its stdout with a deadline:
a serve that prints nothing is given up on in time (it used to block until the test's own
timeout, with its log never shown)."""
from __future__ import annotations

import subprocess
import sys
import time

from cluster.tools.testbed.multi_host import read_endpoints

BANNER = ("pdserve: serving m (1 decode, 1 prefill; max_model_len 512)\n"
          "  gRPC     198.18.0.1:50051   (pdserve.v1.Generation, grpc.health.v1, reflection)\n"
          "  HTTP     http://198.18.0.1:8000   (OpenAI-compatible: /v1/completions)\n"
          "  metrics  http://198.18.0.1:41234/metrics\n"
          "  try:     pdserve generate --target 198.18.0.1:50051 --chat hi\n")


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_reads_the_banner_of_a_serve_that_keeps_running():
    proc = _child(f"import sys, time\nsys.stdout.write({BANNER!r})\nsys.stdout.flush()\ntime.sleep(30)")
    try:
        found = read_endpoints(proc.stdout, timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert found == {"gRPC": "198.18.0.1:50051", "HTTP": "http://198.18.0.1:8000",
                     "metrics": "http://198.18.0.1:41234/metrics"}


def test_a_silent_serve_is_given_up_on_at_the_deadline():
    proc = _child("import time\nprint('pdserve: serving m', flush=True)\ntime.sleep(60)")
    try:
        start = time.monotonic()
        found = read_endpoints(proc.stdout, timeout=1.5)
        waited = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    assert found == {}
    assert waited < 30          # not the child's 60 s: the deadline, not the stream, ended the wait


def test_a_serve_that_exits_early_returns_what_it_printed():
    proc = _child("print('  gRPC     198.18.0.1:50051   (x)', flush=True)")
    found = read_endpoints(proc.stdout, timeout=20)
    proc.wait()
    assert found == {"gRPC": "198.18.0.1:50051"}

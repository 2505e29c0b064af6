"""tests/chaos/chaos_lib.py helpers that the fault scenarios lean on."""
from __future__ import annotations

import builtins
import subprocess

import chaos_lib
from chaos_lib import process_gone


def test_process_gone_for_a_live_an_exited_and_a_vanishing_process(monkeypatch):
    p = subprocess.Popen(["sleep", "30"])
    try:
        assert not process_gone(p.pid)
    finally:
        p.kill()
        p.wait()
    assert process_gone(p.pid)                       # reaped: no /proc entry

    class Vanishing:                                  # exits between the open and the read (ESRCH)
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            raise ProcessLookupError(3, "No such process")

    real_open = builtins.open
    monkeypatch.setattr(chaos_lib, "open", lambda path, *a, **k: Vanishing() if str(path).startswith("/proc/")
                        else real_open(path, *a, **k), raising=False)
    assert process_gone(12345)

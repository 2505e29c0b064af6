"""A process killed while it builds or loads the attention kernel must not hang the next one.

The CI run of 2026-11-30 lost three cluster starts (300 s each): a decode worker the test
shutdown killed in its ``__init__`` held cpp_extension's ``lock`` file, and every worker after
it waited on that file. These tests leave such a file (and a holder killed mid-load) in a
copy of the real build directory and load the kernel in fresh processes.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.attention import kernels

pytestmark = pytest.mark.skipif(not kernels.cpu_kernel_available(), reason="the cpu_paged kernel did not build here")

REPO = Path(__file__).resolve().parents[2]

LOAD = ("import sys; from engine.attention.kernels import load_cpu_kernel; why = load_cpu_kernel(); "
        "print(why); sys.exit(0 if why is None else 1)")

# Takes pdserve's lock, leaves cpp_extension's lock file as a build midway would, and dies by SIGKILL.
DIE_HOLDING = ("import os, signal; from engine.attention import kernels; "
               "b = kernels.kernel_dir() / f'paged_attention_{kernels._build_key()}'\n"
               "with kernels._build_lock(b):\n"
               "    (b / 'lock').touch(); os.kill(os.getpid(), signal.SIGKILL)")


def _run(code: str, kernel_root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PDSERVE_KERNEL_DIR": str(kernel_root), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=180)


def _copy_of_the_build(root: Path) -> Path:
    """The real build directory (built by this process's import) under ``root``, without its locks and mark."""
    name = f"paged_attention_{kernels._build_key()}"
    build = root / name
    shutil.copytree(kernels.kernel_dir() / name, build, ignore=shutil.ignore_patterns("lock", "built*", "pdserve.lock"))
    return build


def test_a_lock_left_by_a_killed_process_does_not_hang_the_next_load(tmp_path):
    build = _copy_of_the_build(tmp_path)

    # 1. No finished-build mark yet: cpp_extension runs (ninja has nothing to do) with a fresh lock file there.
    (build / "lock").touch()
    first = _run(LOAD, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert not (build / "lock").exists()
    assert (build / "built").read_text().strip() == kernels._build_key()

    # 2. A process killed while it held the locks: the next load goes on (the marked build, no ninja).
    died = _run(DIE_HOLDING, tmp_path)
    assert died.returncode == -9, died.stdout + died.stderr
    assert (build / "lock").exists()
    second = _run(LOAD, tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert not (build / "lock").exists()


def test_a_mark_whose_library_does_not_load_is_dropped_and_rebuilt(tmp_path):
    build = _copy_of_the_build(tmp_path)
    (build / "built").write_text(kernels._build_key() + "\n")
    lib = build / "pdserve_paged_attention.so"
    lib.write_bytes(b"not a shared library")
    os.utime(lib, (0, 0))          # older than its objects: ninja links it again
    run = _run(LOAD, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "did not load" in run.stderr
    assert lib.read_bytes()[:4] == b"\x7fELF"

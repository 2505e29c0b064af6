"""Builds and loads the CPU attention kernels (``csrc/*.cpp``) on first use.

The kernel is compiled with ``torch.utils.cpp_extension`` (g++, ninja, ``-O3 -march=native
-fopenmp``) into a cache directory keyed by the source, the torch version and the CPU's
flags, so a process builds it once per machine and every later process (and test) just
loads the shared library; it registers ``torch.ops.pdserve.paged_attention``,
``torch.ops.pdserve.rotary_kv_write`` (RoPE + the K/V write into the pool), ``silu_mul``,
``rms_norm``, ``panel_linear`` (linear layers for a few rows, engine/model/panel_weights.py),
``decoder_layers`` (a step's decoder layers in one call, engine/model/layer_stack.py) and
``pin_intra_op_threads`` (engine/thread_pinning.py).

Cache directory: ``$PDSERVE_KERNEL_DIR`` or ``~/.cache/pdserve/kernels``. Builds and loads
take an ``flock`` there (``_build_lock``), so a process killed midway never blocks the next.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = (_CSRC / "paged_attention.cpp", _CSRC / "rotary_kv.cpp", _CSRC / "silu_mul.cpp",
            _CSRC / "thread_affinity.cpp", _CSRC / "panel_linear.cpp", _CSRC / "rms_norm.cpp",
            _CSRC / "decoder_layers.cpp")
_HEADERS = (_CSRC / "ops.h",)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
_NAME = "pdserve_paged_attention"


def kernel_dir() -> Path:
    root = os.environ.get("PDSERVE_KERNEL_DIR") or os.path.join(Path.home(), ".cache", "pdserve", "kernels")
    return Path(root)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine()


def _build_key() -> str:
    h = hashlib.sha256()
    for part in (*(src.read_bytes() for src in _SOURCES + _HEADERS), torch.__version__.encode(), " ".join(_FLAGS).encode(),
                 _cpu_flags().encode()):
        h.update(part)
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """Holds an exclusive ``flock`` on ``build/pdserve.lock`` while the kernel is built or loaded.

    cpp_extension guards a build directory with a ``lock`` *file* that it waits on, forever,
    for as long as the file exists; a process killed while it holds it (a Ray actor killed in
    its ``__init__``, a timeout) leaves it behind and every later load in that directory hangs.
    A kernel lock is released by the kernel when its holder dies, so with it held no other live
    pdserve process can be inside cpp_extension here, and a ``lock`` file found then is stale.
    """
    with open(build / "pdserve.lock", "a+") as fh:   # closing it releases the flock
        fcntl.flock(fh, fcntl.LOCK_EX)
        stale = build / "lock"
        if stale.exists():
            stale.unlink()
            log.warning("attention: removed a kernel build lock left by a killed process (%s)", stale)
        yield


def _load_built(build: Path) -> bool:
    """Loads the library a finished build left (its ``built`` mark written after it loaded once):
    no ninja run and no cpp_extension lock. False when there is none, or it does not load."""
    lib = build / f"{_NAME}.so"
    if not ((build / "built").exists() and lib.exists()):
        return False
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as exc:
        log.warning("attention: the built kernel %s did not load (%s); building it again", lib, exc)
        (build / "built").unlink(missing_ok=True)
        return False
    return True


def _mark_built(build: Path, key: str) -> None:
    tmp = build / f"built.{os.getpid()}"
    tmp.write_text(key + "\n")
    os.replace(tmp, build / "built")


@functools.lru_cache(maxsize=1)
def load_cpu_kernel() -> str | None:
    """Build (once per machine) and load the kernel; ``None`` when it loaded, else why not."""
    if hasattr(torch.ops, "pdserve") and hasattr(torch.ops.pdserve, "pin_intra_op_threads"):
        return None
    try:
        from torch.utils.cpp_extension import load

        key = _build_key()
        build = kernel_dir() / f"paged_attention_{key}"
        build.mkdir(parents=True, exist_ok=True)
        with _build_lock(build):
            if not _load_built(build):
                load(name=_NAME, sources=[str(src) for src in _SOURCES], extra_cflags=_FLAGS,
                     extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False,
                     verbose=False)
                _mark_built(build, key)
    except Exception as exc:  # no compiler, no ninja, a read-only cache dir, ...: say why once
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    return None


def cpu_kernel_available() -> bool:
    return load_cpu_kernel() is None

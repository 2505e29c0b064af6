"""Builds and loads the CPU attention kernels (``csrc/*.cpp``) on first use.

The kernel is compiled with ``torch.utils.cpp_extension`` (g++, ninja, ``-O3 -march=native
-fopenmp``) into a cache directory keyed by the source, the torch version and the CPU's
flags, so a process builds it once per machine and every later process (and test) just
loads the shared library; it registers ``torch.ops.pdserve.paged_attention``,
``torch.ops.pdserve.rotary_kv_write`` (RoPE + the K/V write into the pool), ``silu_mul``,
``rms_norm``, ``panel_linear`` (linear layers for a few rows, engine/model/panel_weights.py),
``decoder_layers`` (a step's decoder layers in one call, engine/model/layer_stack.py) and
``pin_intra_op_threads`` (engine/thread_pinning.py).

Cache directory: ``$PDSERVE_KERNEL_DIR`` or ``~/.cache/pdserve/kernels``.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = (_CSRC / "paged_attention.cpp", _CSRC / "rotary_kv.cpp", _CSRC / "silu_mul.cpp",
            _CSRC / "thread_affinity.cpp", _CSRC / "panel_linear.cpp", _CSRC / "rms_norm.cpp",
            _CSRC / "decoder_layers.cpp")
_HEADERS = (_CSRC / "ops.h",)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]


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


def _drop_stale_lock(lock: Path, max_age_s: float = 600.0) -> None:
    """cpp_extension waits for ``lock`` to vanish; one left by a build killed midway (a
    timeout, a crash) would hang every later load. A build takes well under a minute."""
    try:
        if time.time() - lock.stat().st_mtime > max_age_s:
            lock.unlink()
            log.warning("attention: removed a stale kernel build lock %s", lock)
    except FileNotFoundError:
        pass


@functools.lru_cache(maxsize=1)
def load_cpu_kernel() -> str | None:
    """Build (once per machine) and load the kernel; ``None`` when it loaded, else why not."""
    if hasattr(torch.ops, "pdserve") and hasattr(torch.ops.pdserve, "pin_intra_op_threads"):
        return None
    try:
        from torch.utils.cpp_extension import load

        build = kernel_dir() / f"paged_attention_{_build_key()}"
        build.mkdir(parents=True, exist_ok=True)
        _drop_stale_lock(build / "lock")
        load(name="pdserve_paged_attention", sources=[str(src) for src in _SOURCES], extra_cflags=_FLAGS,
             extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False,
             verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache dir, ...: say why once
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    return None


def cpu_kernel_available() -> bool:
    return load_cpu_kernel() is None

"""The CPU's instruction-set flags, read once from /proc/cpuinfo: what decides the engine's
CPU paths (engine/model/packed_linear.py: packed bf16 weights want avx512_bf16 or AMX; the
attention kernel's vector width is the compiler's -march=native, engine/attention/kernels.py)."""
from __future__ import annotations

import functools


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The x86 ``flags`` of ``cpuinfo`` (/proc/cpuinfo's text, read when None), as whole words;
    empty where there is no such line (ARM lists ``Features``; a machine without /proc)."""
    if cpuinfo is None:
        return _this_cpu()
    return frozenset(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                           if line.startswith("flags") and ":" in line), []))


@functools.lru_cache(maxsize=1)
def _this_cpu() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_flags(f.read())
    except OSError:
        return frozenset()

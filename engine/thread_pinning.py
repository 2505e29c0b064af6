"""Pinning the engine's intra-op (OpenMP) threads to distinct cores (``EngineConfig.omp_threads_bind``).

torch's CPU ops (its own kernels, oneDNN, MKL and pdserve's kernels) share one OpenMP team per
calling thread: the thread that runs the engine's steps is team thread 0 and the others are
GOMP workers. Unpinned, the kernel may put two of them on one core for a while (another
process's thread on the host is enough), and every fork/join of a step then waits for a time
slice. vLLM pins its team the same way (``VLLM_CPU_OMP_THREADS_BIND``).

``omp_threads_bind`` values: ``"off"`` (leave the threads to the kernel), ``"auto"`` (pin when
the team has the stepping thread's cores to itself: as many intra-op threads as cores in that
thread's affinity mask, thread i to the i-th core; otherwise left unpinned, so engines that
share a host with fewer threads each do not all land on its first cores) or a core list such
as ``"0-1"`` / ``"2,3"`` (one core per thread, each in the mask; team thread i to the i-th).
Pinning happens on the first step of each thread that steps the engine (``ThreadPinner.ensure``);
``release()`` gives that thread its own mask back (``LLM.generate`` does at its end, so the
caller's thread is pinned only while it steps; the GOMP workers stay pinned). Threads the
stepping thread creates while pinned inherit its single core.
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)


def parse_bind(spec: str) -> tuple[int, ...] | None:
    """``"off"`` -> None, ``"auto"`` -> (), ``"0-1,4"`` -> (0, 1, 4); ValueError says how to fix it."""
    if spec in ("off", "auto"):
        return None if spec == "off" else ()
    cores: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError
            cores.extend(range(first, last + 1))
    except ValueError:
        raise ValueError(f"omp_threads_bind must be 'off', 'auto' or a core list such as '0-1' or '0,2', "
                         f"got {spec!r}") from None
    if len(set(cores)) != len(cores):
        raise ValueError(f"omp_threads_bind lists a core twice ({spec!r}): give each thread its own core")
    return tuple(cores)


def resolve_cores(spec: str, threads: int, allowed: set[int]) -> tuple[int, ...] | None:
    """The core of each of ``threads`` team threads, or None to leave them unpinned."""
    cores = parse_bind(spec)
    if cores is None:
        return None
    if cores == ():
        if len(allowed) != threads:
            log.info("omp_threads_bind=auto: %d intra-op threads for the %d cores of this thread's mask %s: "
                     "left unpinned (give a core list to pin them)", threads, len(allowed), sorted(allowed))
            return None
        return tuple(sorted(allowed))
    if len(cores) < threads:
        raise ValueError(f"omp_threads_bind={spec!r} lists {len(cores)} core(s) for {threads} intra-op threads: "
                         f"list one core per thread, or lower the threads (torch.set_num_threads / OMP_NUM_THREADS)")
    if not set(cores) <= allowed:
        raise ValueError(f"omp_threads_bind={spec!r} names cores {sorted(set(cores) - allowed)} outside this "
                         f"process's affinity mask {sorted(allowed)}: pick cores from the mask")
    return cores[:threads]


def pin_intra_op_threads(cores: tuple[int, ...], required: bool = True) -> dict[int, int]:
    """Pin the calling thread's OpenMP team, thread i to ``cores[i]``; returns {thread id: core}.
    Without pdserve's CPU kernels: RuntimeError if ``required``, else a warning and {}."""
    import torch

    from engine.attention.kernels import load_cpu_kernel

    why = load_cpu_kernel()
    if why is not None:
        if not required:
            log.warning("omp_threads_bind=auto: threads left unpinned, pdserve's CPU kernels did not build (%s)", why)
            return {}
        raise RuntimeError(f"pinning needs pdserve's CPU kernels, which did not build ({why}): "
                           f"set omp_threads_bind='off'")
    tids = list(torch.ops.pdserve.pin_intra_op_threads(list(cores)))
    if len(set(tids)) != len(tids):
        log.warning("omp_threads_bind: the OpenMP team ran %d of %d threads; the rest stay unpinned",
                    len(set(tids)), len(tids))
    return dict(zip(tids, cores))


class ThreadPinner:
    """Pins, once per stepping thread, that thread's team per ``spec`` (``"off"``: never)."""

    def __init__(self, spec: str) -> None:
        parse_bind(spec)
        self.spec = spec
        self._masks: dict[int, set[int]] = {}   # stepping thread -> its mask before the pinning
        self.pinned: dict[int, int] = {}         # kernel thread id -> core, every team pinned so far

    def ensure(self) -> None:
        if self.spec == "off" or threading.get_ident() in self._masks:
            return
        import torch

        mask = os.sched_getaffinity(0)
        self._masks[threading.get_ident()] = mask
        cores = resolve_cores(self.spec, torch.get_num_threads(), mask)
        if cores is not None:
            self.pinned.update(pin_intra_op_threads(cores, required=self.spec != "auto"))
            log.info("omp_threads_bind=%s: intra-op threads pinned %s", self.spec, self.pinned)

    def release(self) -> None:
        """Give the calling thread its mask from before ``ensure``; its next step pins again."""
        mask = self._masks.pop(threading.get_ident(), None)
        if mask is not None and os.sched_getaffinity(0) != mask:
            os.sched_setaffinity(0, mask)

"""Large CPU tensors on transparent huge pages (2 MiB) where Linux offers them.

The KV pool is read in scattered blocks every decode step (a 32 x 512 fp32 batch reads
~25 MB a layer from a multi-GiB pool). On 4 KiB pages nearly every block read also misses
the TLB; with the pool on 2 MiB pages those walks mostly go away (measured in
docs/benchmarks.md, "Decode attention at streaming speed"). This host's kernel has THP in
``madvise`` mode, so the pool asks for them with ``madvise(MADV_HUGEPAGE)`` before its pages
are first touched. Elsewhere (no libc ``madvise``, another OS, a non-CPU device) the tensor
is an ordinary ``torch.zeros``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _advise_huge(addr: int, nbytes: int) -> bool:
    """``madvise(MADV_HUGEPAGE)`` on the whole 2 MiB pages inside ``[addr, addr + nbytes)``."""
    start = -(-addr // HUGE_PAGE) * HUGE_PAGE
    end = (addr + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return False
    return True


def zeros(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape)``; on the CPU its memory is advised onto huge pages first."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    t = torch.empty(shape, dtype=dtype)
    if t.numel() * t.element_size() >= 2 * HUGE_PAGE:
        _advise_huge(t.data_ptr(), t.numel() * t.element_size())
    return t.zero_()

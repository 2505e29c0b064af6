"""engine.huge_pages: the KV pool's memory is zeroed and, where Linux has THP, on 2 MiB pages."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine import huge_pages
from engine.config import ModelConfig
from engine.kv_pool import KVPool

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib_in(addr: int, nbytes: int) -> int:
    """AnonHugePages of the mappings that overlap ``[addr, addr + nbytes)`` (/proc/self/smaps;
    madvise splits the tensor's mapping at the 2 MiB boundaries)."""
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) < addr + nbytes and addr < int(m.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_zeros_are_zeros_of_the_shape_and_dtype():
    t = huge_pages.zeros((3, 5, 7), dtype=torch.bfloat16, device="cpu")
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and not t.any()
    dirty = torch.full((6, 1 << 20), 7.0)     # 24 MiB freed, so the next allocation may reuse it
    del dirty
    big = huge_pages.zeros((6, 1 << 20), dtype=torch.float32, device="cpu")
    assert not big.any()


@pytest.mark.skipif(not _THP.exists() or "[never]" in _THP.read_text(), reason="no transparent huge pages")
def test_a_large_kv_pool_lands_on_huge_pages():
    model = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                        num_kv_heads=2, head_dim=16)
    pool = KVPool(model, num_blocks=4096, block_size=16, device="cpu", dtype=torch.float32)  # 32 MiB
    nbytes = pool.tensor.numel() * pool.tensor.element_size()
    assert _huge_kib_in(pool.tensor.data_ptr(), nbytes) * 1024 >= nbytes - 2 * huge_pages.HUGE_PAGE

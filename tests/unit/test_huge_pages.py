"""engine.huge_pages: the KV pool's memory is zeroed and, where Linux has THP, advised onto 2 MiB pages."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine import huge_pages
from engine.config import ModelConfig
from engine.kv_pool import KVPool

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _advised(addr: int, nbytes: int) -> list[bool]:
    """For each mapping that overlaps the whole 2 MiB pages of ``[addr, addr + nbytes)``, whether
    it carries MADV_HUGEPAGE (``hg`` in its /proc/self/smaps VmFlags). madvise splits the
    tensor's mapping at the 2 MiB boundaries, but the kernel merges the advised part with an
    advised neighbour (another pool freed or alive earlier in the process), so a mapping may
    reach past the range: overlapping, not inside, is what is checked. Whether the kernel then backs it with huge pages
    (AnonHugePages) depends on free, unfragmented memory at fault time, not on pdserve."""
    lo = -(-addr // huge_pages.HUGE_PAGE) * huge_pages.HUGE_PAGE
    hi = (addr + nbytes) // huge_pages.HUGE_PAGE * huge_pages.HUGE_PAGE
    inside, out = False, []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) < hi and lo < int(m.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            out.append("hg" in line.split()[1:])
    return out


def test_zeros_are_zeros_of_the_shape_and_dtype():
    t = huge_pages.zeros((3, 5, 7), dtype=torch.bfloat16, device="cpu")
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and not t.any()
    dirty = torch.full((6, 1 << 20), 7.0)     # 24 MiB freed, so the next allocation may reuse it
    del dirty
    big = huge_pages.zeros((6, 1 << 20), dtype=torch.float32, device="cpu")
    assert not big.any()


@pytest.mark.skipif(not _THP.exists() or "[never]" in _THP.read_text(), reason="no transparent huge pages")
def test_a_large_kv_pool_is_advised_onto_huge_pages():
    """Beside another advised pool, as in a full test run (their mappings may merge)."""
    model = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                        num_kv_heads=2, head_dim=16)
    neighbour = KVPool(model, num_blocks=4096, block_size=16, device="cpu", dtype=torch.float32)  # noqa: F841
    pool = KVPool(model, num_blocks=4096, block_size=16, device="cpu", dtype=torch.float32)  # 64 MiB
    nbytes = pool.tensor.numel() * pool.tensor.element_size()
    advised = _advised(pool.tensor.data_ptr(), nbytes)
    assert advised and all(advised), advised

"""Block tables -> the fewest (src_addr, dst_addr, nbytes) transfer descriptors.

Posting descriptors, not bandwidth, is what slows real transfers, so pairs
``(src[i], dst[i])`` that continue a run on *both* sides (``src[i] ==
src[i-1] + 1`` and ``dst[i] == dst[i-1] + 1``) are merged into one
descriptor. Order follows the input block table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvtransfer.layout import KVPoolLayout


@dataclass(frozen=True)
class BlockRun:
    src_start: int
    dst_start: int
    count: int


@dataclass(frozen=True)
class Descriptor:
    src_addr: int
    dst_addr: int
    nbytes: int


def validate_block_ids(src_ids: Sequence[int], dst_ids: Sequence[int],
                       src_num_blocks: int, dst_num_blocks: int) -> None:
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"got {len(src_ids)} source and {len(dst_ids)} destination block ids: "
                         "pass one destination block per source block")
    for name, ids, limit in (("source", src_ids, src_num_blocks),
                             ("destination", dst_ids, dst_num_blocks)):
        bad = [b for b in ids if not 0 <= int(b) < limit]
        if bad:
            raise ValueError(f"{name} block ids {bad[:8]} are out of range [0, {limit}): "
                             f"use ids of the {name} pool")
    seen: set[int] = set()
    repeated: set[int] = set()
    for d in dst_ids:
        (repeated if int(d) in seen else seen).add(int(d))
    dups = sorted(repeated)
    if dups:
        raise ValueError(f"destination block ids repeat ({dups[:8]}): "
                         "each destination block can receive only one source block")


def coalesce_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[BlockRun]:
    """Merge pairs consecutive on both sides into runs (no validation)."""
    runs: list[BlockRun] = []
    for s, d in zip(src_ids, dst_ids):
        s, d = int(s), int(d)
        if runs:
            last = runs[-1]
            if s == last.src_start + last.count and d == last.dst_start + last.count:
                runs[-1] = BlockRun(last.src_start, last.dst_start, last.count + 1)
                continue
        runs.append(BlockRun(s, d, 1))
    return runs


def build_descriptors(src: KVPoolLayout, dst: KVPoolLayout, src_ids: Sequence[int],
                      dst_ids: Sequence[int]) -> list[Descriptor]:
    """Descriptors reading ``src_ids`` of ``src`` into ``dst_ids`` of ``dst``."""
    if src.block_transfer_bytes != dst.block_transfer_bytes:
        raise ValueError(f"source moves {src.block_transfer_bytes} bytes per block but the "
                         f"destination expects {dst.block_transfer_bytes}: both pools must "
                         "use the same block shape, dtype and head slice")
    validate_block_ids(src_ids, dst_ids, src.num_blocks, dst.num_blocks)
    per = src.block_transfer_bytes
    if src.whole_blocks and dst.whole_blocks:
        return [Descriptor(src.block_addr(r.src_start), dst.block_addr(r.dst_start), per * r.count)
                for r in coalesce_runs(src_ids, dst_ids)]
    return [Descriptor(src.block_addr(int(s)), dst.block_addr(int(d)), per)
            for s, d in zip(src_ids, dst_ids)]

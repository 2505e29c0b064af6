"""Which bytes of which prefill rank's blocks a decode rank reads, across TP sizes.

With tensor parallelism each rank's KV pool holds only its KV heads:

    rank pool  [num_blocks, num_layers, 2 (K|V), local_kv_heads, tile]

(``tile`` = one head's ``block_size`` tokens, scales included for a quantized
cache). A decode rank must read exactly the heads it owns, from prefill ranks
that hold them, straight into its own blocks. Inside a block the heads of one
(layer, K|V) are contiguous, so a head range is ``2 x num_layers`` segments of
``heads x tile`` bytes each, one per (layer, K|V):

- When the two sides split the heads the same way (equal TP sizes, or any
  pair where a decode rank's heads are exactly one prefill rank's heads) every
  segment continues the previous one on both sides, they merge into the whole
  block, and runs of consecutive blocks merge further: the same descriptors as
  without TP, one per run of blocks, per rank.
- When they do not (e.g. prefill TP=2 into decode TP=1: the decode rank's
  block interleaves both prefill ranks' heads per layer), each block costs
  ``2 x num_layers`` descriptors per source rank it reads from, each
  ``heads x tile`` bytes long. For a model with 32 layers and 8 KV heads of
  head_dim 128 at fp16, block 16 (4 KiB tiles), prefill TP=2 into decode TP=1
  reads 64 descriptors of 16 KiB from each prefill rank per block instead of
  one 2 MiB descriptor per run of blocks. The bytes are the same; posting many
  small descriptors is what costs (docs/kvtransfer.md).

Ranks beyond the KV-head count replicate heads (the engine's sharding rule):
a decode rank then reads its heads from the first prefill rank that holds
them, spread over the replicas by decode rank so no prefill rank serves every
reader.

This module knows no model and no engine: it takes each rank's head range
and the tile size in bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvtransfer.descriptors import Descriptor, coalesce_runs, validate_block_ids
from kvtransfer.layout import KVPoolLayout


@dataclass(frozen=True)
class HeadShard:
    """The KV heads ``[first_head, first_head + num_heads)`` a rank's pool holds, in order."""
    first_head: int
    num_heads: int

    def __post_init__(self) -> None:
        if self.first_head < 0 or self.num_heads <= 0:
            raise ValueError(f"a rank holds num_heads >= 1 KV heads from first_head >= 0, got "
                             f"first_head={self.first_head}, num_heads={self.num_heads}")

    @property
    def end(self) -> int:
        return self.first_head + self.num_heads


@dataclass(frozen=True)
class BlockShape:
    """What a (layer, K|V) slice of one rank's block holds: ``num_layers`` and one head's tile bytes."""
    num_layers: int
    tile_bytes: int

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or self.tile_bytes <= 0:
            raise ValueError(f"num_layers and tile_bytes must be > 0, got {self.num_layers}, "
                             f"{self.tile_bytes}")

    def block_bytes(self, shard: HeadShard) -> int:
        return 2 * self.num_layers * shard.num_heads * self.tile_bytes


@dataclass(frozen=True)
class Segment:
    """Bytes ``[src_offset, src_offset + nbytes)`` of a source rank's block land at
    ``[dst_offset, ...)`` of the destination rank's block."""
    src_rank: int
    src_offset: int
    dst_offset: int
    nbytes: int


def head_shards(num_kv_heads: int, tp_size: int) -> list[HeadShard]:
    """Each rank's KV heads: ``num_kv_heads / tp`` apiece, or one head replicated on
    ``tp / num_kv_heads`` consecutive ranks when ranks outnumber heads."""
    if num_kv_heads <= 0 or tp_size <= 0:
        raise ValueError(f"num_kv_heads and tp_size must be >= 1, got {num_kv_heads}, {tp_size}")
    if num_kv_heads % tp_size == 0:
        per = num_kv_heads // tp_size
        return [HeadShard(r * per, per) for r in range(tp_size)]
    if tp_size % num_kv_heads == 0:
        reps = tp_size // num_kv_heads
        return [HeadShard(r // reps, 1) for r in range(tp_size)]
    raise ValueError(f"tensor parallel size {tp_size} neither divides nor is a multiple of the "
                     f"model's {num_kv_heads} KV heads: use a divisor or a multiple of {num_kv_heads}")


def _sources(src: Sequence[HeadShard], head: int, dst_rank: int) -> int:
    """The source rank a destination rank reads ``head`` from (replicas spread by reader)."""
    holders = [r for r, s in enumerate(src) if s.first_head <= head < s.end]
    if not holders:
        raise ValueError(f"no source rank holds KV head {head}: the prefill ranks' heads "
                         f"{[(s.first_head, s.end) for s in src]} must cover every head")
    return holders[dst_rank % len(holders)]


def plan_segments(src: Sequence[HeadShard], dst: HeadShard, dst_rank: int,
                  shape: BlockShape) -> list[Segment]:
    """The segments of one block that destination rank ``dst_rank`` (holding ``dst``)
    reads, merged where they continue each other on both sides (in the best case
    one segment per source rank covering the whole block)."""
    # which source rank serves each of our heads, as runs of heads served by one rank
    runs: list[tuple[int, int, int]] = []                   # (src_rank, first_head, count)
    for h in range(dst.first_head, dst.end):
        r = _sources(src, h, dst_rank)
        if runs and runs[-1][0] == r and runs[-1][1] + runs[-1][2] == h:
            runs[-1] = (r, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((r, h, 1))
    t = shape.tile_bytes
    segs: list[Segment] = []
    for slab in range(2 * shape.num_layers):                # (layer, K|V) in pool order
        for r, h0, n in runs:
            s = src[r]
            seg = Segment(r, (slab * s.num_heads + h0 - s.first_head) * t,
                          (slab * dst.num_heads + h0 - dst.first_head) * t, n * t)
            last = segs[-1] if segs else None
            if (last is not None and last.src_rank == r and last.src_offset + last.nbytes == seg.src_offset
                    and last.dst_offset + last.nbytes == seg.dst_offset):
                segs[-1] = Segment(r, last.src_offset, last.dst_offset, last.nbytes + seg.nbytes)
            else:
                segs.append(seg)
    return segs


def segment_descriptors(src: KVPoolLayout, dst: KVPoolLayout, src_ids: Sequence[int],
                        dst_ids: Sequence[int], segments: Sequence[Segment]) -> list[Descriptor]:
    """Descriptors reading one source rank's ``segments`` of blocks ``src_ids`` into ``dst_ids``.
    A segment that is the whole block on both sides merges runs of consecutive blocks."""
    validate_block_ids(src_ids, dst_ids, src.num_blocks, dst.num_blocks)
    out: list[Descriptor] = []
    for seg in segments:
        if seg.src_offset + seg.nbytes > src.bytes_per_block or seg.dst_offset + seg.nbytes > dst.bytes_per_block:
            raise ValueError(f"segment {seg} reaches past a block ({src.bytes_per_block} B source, "
                             f"{dst.bytes_per_block} B destination): plan it with the pools' own shapes")
    whole = [s for s in segments if s.nbytes == src.bytes_per_block == dst.bytes_per_block]
    if whole:
        return [Descriptor(src.base_addr + r.src_start * src.bytes_per_block,
                           dst.base_addr + r.dst_start * dst.bytes_per_block, r.count * src.bytes_per_block)
                for r in coalesce_runs(src_ids, dst_ids)]
    for s_id, d_id in zip(src_ids, dst_ids):
        s_base = src.base_addr + int(s_id) * src.bytes_per_block
        d_base = dst.base_addr + int(d_id) * dst.bytes_per_block
        out.extend(Descriptor(s_base + seg.src_offset, d_base + seg.dst_offset, seg.nbytes) for seg in segments)
    return out

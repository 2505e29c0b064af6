"""One destination rank's read of its KV heads from the source ranks that hold them.

A tensor-parallel hand-off (docs/tensor_parallel.md) is one of these per decode rank, each
over the rank's own transfer engine, followed by one notify-only read to the source's rank 0
(:func:`notify_source`) once every rank's read is done: the source's lease (on its rank 0)
ends only then. The plan comes from :mod:`kvtransfer.head_plan`; this module posts it and
waits (blocking: call it off the event loop).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvtransfer.engine import PeerInfo, TransferEngine, TransferHandle, TransferStatus
from kvtransfer.handle import RankSource
from kvtransfer.head_plan import BlockShape, HeadShard, Segment, plan_segments
from kvtransfer.layout import KVPoolLayout


@dataclass(frozen=True)
class HeadReadResult:
    status: TransferStatus
    nbytes: int = 0
    descriptors: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status is TransferStatus.DONE


def block_shape(layout: KVPoolLayout, shard: HeadShard, num_layers: int) -> BlockShape:
    """A rank pool's (layer, K|V) tile size: its block is ``2 x num_layers x heads`` tiles."""
    per = 2 * num_layers * shard.num_heads
    if layout.bytes_per_block % per:
        raise ValueError(f"a block of {layout.bytes_per_block} B does not split into {per} head tiles "
                         f"({num_layers} layers x K|V x {shard.num_heads} heads): pass the pool's own "
                         "num_layers and head shard")
    return BlockShape(num_layers, layout.bytes_per_block // per)


def plan_rank_read(sources: Sequence[RankSource], dst: HeadShard, dst_rank: int, dst_layout: KVPoolLayout,
                   num_layers: int) -> list[tuple[PeerInfo, list[Segment]]]:
    """Which segments destination rank ``dst_rank`` reads from which source rank (in source rank order)."""
    shape = block_shape(dst_layout, dst, num_layers)
    for s in sources:
        if block_shape(s.peer.layout, s.shard, num_layers) != shape:
            raise ValueError(f"source {s.peer.agent_name!r} stores {block_shape(s.peer.layout, s.shard, num_layers)} "
                             f"per head but this rank {shape}: start both pools with the same model, dtype, "
                             "kv_cache_dtype and block size")
    segs = plan_segments([s.shard for s in sources], dst, dst_rank, shape)
    by_rank: dict[int, list[Segment]] = {}
    for seg in segs:
        by_rank.setdefault(seg.src_rank, []).append(seg)
    return [(sources[r].peer, by_rank[r]) for r in sorted(by_rank)]


def read_heads(engine: TransferEngine, sources: Sequence[RankSource], dst: HeadShard, dst_rank: int,
               num_layers: int, src_ids: Sequence[int], dst_ids: Sequence[int], timeout_s: float) -> HeadReadResult:
    """Read this rank's heads of blocks ``src_ids`` into ``dst_ids``, from every source rank
    that serves them, all posted before any is waited for. No notification is sent."""
    try:
        plan = plan_rank_read(sources, dst, dst_rank, engine.layout, num_layers)
        handles: list[TransferHandle] = [engine.read_segments(peer, src_ids, dst_ids, segs) for peer, segs in plan]
    except Exception as e:        # a source unreachable, a plan that does not fit
        return HeadReadResult(TransferStatus.FAILED, error=f"{type(e).__name__}: {e}")
    return _wait_all(handles, timeout_s)


def notify_source(engine: TransferEngine, peer: PeerInfo, notify: bytes, timeout_s: float) -> HeadReadResult:
    """Tell the source's rank 0 every rank's read is done (an empty read carrying ``notify``):
    its lease ends. FAILED when the source no longer held the lease (the blocks may have been
    reused meanwhile: recompute)."""
    try:
        handle = engine.read_segments(peer, [], [], [], notify=notify)
    except Exception as e:
        return HeadReadResult(TransferStatus.FAILED, error=f"{type(e).__name__}: {e}")
    return _wait_all([handle], timeout_s)


def _wait_all(handles: list[TransferHandle], timeout_s: float) -> HeadReadResult:
    status, error = TransferStatus.DONE, ""
    for h in handles:
        s = h.wait(timeout_s)     # posted together: the later ones finish meanwhile
        if s is not TransferStatus.DONE and status is TransferStatus.DONE:
            status, error = s, h.error or s.value
    return HeadReadResult(status, sum(h.nbytes for h in handles), sum(h.descriptors for h in handles), error)

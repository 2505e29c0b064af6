"""KVPull: how a decode worker pulls a hand-off's KV into the blocks it allocated.

- **Reads ahead** (`read_ahead`): while the blocks are reserved and the prefill node
  still computes, each message of completed blocks (or layer groups of the last
  chunk) becomes one read into the reservation, started at once.
- **The claim** (`claim`, at the submit): wait for those reads (nothing may write into
  the blocks once the engine has them), keep the ones that ended well and still
  describe the handle's KV, and plan what is still missing: per block, the layer
  ranges no good read covered (decode_worker/read_ahead.py `plan_rest`).
- **The rest** (`read_rest`): the missing blocks and layer ranges, one read after
  the other; the last carries the notification that ends the source's lease, so no
  read of its blocks follows it. Across tensor-parallel ranks every rank reads its
  heads, then rank 0 notifies.
- **Bytes**: what the reads reported moving (the reads ahead that ended well, used
  or read again, and the submit's reads).

Every transfer-engine call runs on one thread (backends need not be thread-safe).
The worker (decode_worker/worker.py) keeps the reservations, the room wait and the
engine calls; this module only moves bytes and keeps the reads ahead.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from decode_worker.read_ahead import AheadRead, LayerRange, PendingRead, ReadResult, RestPlan, finished_well, plan_rest
from engine.scheduler import RemoteAllocation
from kvtransfer.engine import PeerInfo, TransferEngine, TransferStatus
from kvtransfer.handle import KVHandle, RankSource
from kvtransfer.head_plan import HeadShard, Segment
from kvtransfer.head_read import HeadReadResult, notify_source, read_heads
from worker_api.base import KVHeads

NO_TRANSFER = "a colocated worker moves no KV: submit it without a handle"


@dataclass(frozen=True)
class Claim:
    """A submit's view of its reservation: what it still reads, and the bytes the reads
    ahead moved."""
    plan: RestPlan
    ahead_bytes: int


class KVPull:
    def __init__(self, transfer: TransferEngine | None, kv_heads: KVHeads, tp_actors: Sequence[Any],
                 timeout: float) -> None:
        self.transfer, self.kv_heads, self.tp_actors, self.timeout = transfer, kv_heads, tp_actors, timeout
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-pull")
        self._ahead: dict[str, list[PendingRead]] = {}   # reads into reserved blocks before the submit

    # ------------------------------------------------------------ reads ahead
    def read_ahead(self, request_id: str, alloc: RemoteAllocation, peer: PeerInfo, first_index: int,
                   block_ids: tuple[int, ...], preemptions: int, layers: LayerRange | None) -> None:
        """Start reading prompt blocks `first_index`.. (the source's `block_ids`), or only
        their `layers`, into `alloc`. Nothing for layers this backend cannot read apart, nor
        for a TP worker (every rank reads its heads at the submit)."""
        if self.tp_actors:
            return
        segments = None if layers is None else self._layer_segments(peer, layers)
        if layers is not None and segments is None:
            return
        end = min(first_index + len(block_ids), len(alloc.block_ids))
        indices = tuple(range(max(first_index, alloc.num_cached_blocks), end))
        if not indices:
            return
        src = tuple(block_ids[i - first_index] for i in indices)
        task = asyncio.get_running_loop().create_task(
            self._read(peer, list(src), [alloc.block_ids[i] for i in indices], b"", segments))
        read = AheadRead(source=(peer.agent_name, peer.incarnation), indices=indices, src=src,
                         preemptions=preemptions, layers=layers)
        self._ahead.setdefault(request_id, []).append(PendingRead(read, task))

    async def settle(self, request_id: str) -> list[PendingRead]:
        """Wait for the reads into `request_id`'s reserved blocks: before the blocks are
        freed or handed to the engine, nothing may still write into them."""
        reads = self._ahead.pop(request_id, [])
        if reads:
            await asyncio.gather(*(r.task for r in reads), return_exceptions=True)
        return reads

    async def claim(self, request_id: str, handle: KVHandle, alloc: RemoteAllocation) -> Claim:
        """The submit takes the reservation: its reads ahead settled, what is left to read."""
        pending = await self.settle(request_id)
        good = finished_well(pending)
        plan = plan_rest([p.read for p in good], source=(handle.peer.agent_name, handle.peer.incarnation),
                         preemptions=handle.preemptions, src_blocks=handle.block_ids,
                         first=alloc.num_cached_blocks, end=len(alloc.block_ids), num_layers=self.kv_heads.num_layers)
        return Claim(plan, ahead_bytes=sum(p.task.result()[1] for p in good))

    # ------------------------------------------------------------- the rest
    async def read_rest(self, handle: KVHandle, alloc: RemoteAllocation, plan: RestPlan, notify: bytes) -> ReadResult:
        """The submit's reads, one after the other: the last carries `notify`, which ends the
        source's lease, so that no read of its blocks follows it. Whole blocks as one read
        (across tensor-parallel ranks too); layer ranges left by a layer-wise read ahead as
        one segment per range and block."""
        status, nbytes, ndesc, err = TransferStatus.DONE, 0, 0, ""
        for k, rest in enumerate(plan.reads):
            note = notify if k == len(plan.reads) - 1 else b""
            src = [handle.block_ids[i] for i in rest.indices]
            dst = [alloc.block_ids[i] for i in rest.indices]
            if rest.whole(self.kv_heads.num_layers):
                status, nb, nd, err = await self._read_handle(handle, src, dst, note)
            else:
                status, nb, nd, err = await self._read(handle.peer, src, dst, note, self._segments(rest.layers))
            nbytes, ndesc = nbytes + nb, ndesc + nd
            if status is not TransferStatus.DONE:
                break
        return status, nbytes, ndesc, err

    def _layer_segments(self, peer: PeerInfo, layers: LayerRange) -> list[Segment] | None:
        """The one byte segment of each block that holds `layers`; None where it cannot be
        read apart (no segment reads in this backend, another block shape at the source)."""
        if self.transfer is None or not self.transfer.reads_segments:
            return None
        ours = self.transfer.layout
        if peer.layout.bytes_per_block != ours.bytes_per_block or not ours.whole_blocks:
            return None
        try:
            return self._segments((layers,))
        except ValueError:    # not a layer range of this model
            return None

    def _segments(self, ranges: Sequence[LayerRange]) -> list[Segment]:
        """One segment per layer range: its bytes in every block (same offset on both sides)."""
        assert self.transfer is not None
        out = []
        for first, end in ranges:
            offset, nbytes = self.transfer.layout.layer_range(self.kv_heads.num_layers, first, end)
            out.append(Segment(0, offset, offset, nbytes))
        return out

    async def _read_handle(self, handle: KVHandle, src: list[int], dst: list[int], notify: bytes) -> ReadResult:
        """Read the handle's blocks `src` into ours `dst`; across tensor-parallel ranks when
        either side splits the KV heads (every rank reads its heads, then rank 0 notifies)."""
        if not handle.tensor_parallel and not self.tp_actors:
            return await self._read(handle.peer, src, dst, notify)
        transfer = self.transfer
        if transfer is None:
            return TransferStatus.FAILED, 0, 0, NO_TRANSFER
        sources = handle.ranks or (RankSource(handle.peer, HeadShard(0, self.kv_heads.num_kv_heads)),)
        heads, timeout = self.kv_heads, self.timeout
        loop = asyncio.get_running_loop()
        own = loop.run_in_executor(self._thread, lambda: read_heads(
            transfer, sources, heads.shard, 0, heads.num_layers, src, dst, timeout))
        others = [asyncio.wrap_future(a.read_heads.remote(sources, src, dst).future()) for a in self.tp_actors]
        results = await asyncio.gather(own, *others, return_exceptions=True)
        done = [r for r in results if isinstance(r, HeadReadResult)]
        nbytes, ndesc = sum(r.nbytes for r in done), sum(r.descriptors for r in done)
        for r in results:
            if not isinstance(r, HeadReadResult):    # a rank actor died: its worker goes down too
                return TransferStatus.FAILED, nbytes, ndesc, f"{type(r).__name__}: {r}"
            if not r.ok:
                return r.status, nbytes, ndesc, r.error
        note = await loop.run_in_executor(self._thread, lambda: notify_source(
            transfer, handle.peer, notify, timeout))
        return note.status, nbytes, ndesc + note.descriptors, note.error

    async def _read(self, peer: PeerInfo, src: list[int], dst: list[int], notify: bytes,
                    segments: list[Segment] | None = None) -> ReadResult:
        """Read `peer`'s blocks `src` into ours `dst` (only the byte `segments` of each, if
        given): (status, bytes, descriptors, error). `notify` (the request id) tells the
        source the read is done: its lease ends."""
        transfer = self.transfer
        if transfer is None:   # colocated: nothing to read with; the caller recomputes or reports
            return TransferStatus.FAILED, 0, 0, NO_TRANSFER
        loop = asyncio.get_running_loop()
        try:
            xfer = await loop.run_in_executor(self._thread, lambda: transfer.read(
                peer, src, dst, notify=notify) if segments is None else transfer.read_segments(
                peer, src, dst, segments, notify=notify))
        except Exception as e:   # peer unreachable / gone
            return TransferStatus.FAILED, 0, 0, f"{type(e).__name__}: {e}"
        deadline = time.monotonic() + self.timeout
        while True:
            status = await loop.run_in_executor(self._thread, xfer.poll)
            if status is not TransferStatus.PENDING:
                return status, xfer.nbytes, xfer.descriptors, xfer.error or ""
            if time.monotonic() > deadline:
                await loop.run_in_executor(self._thread, xfer.abandon)
                return TransferStatus.TIMEOUT, 0, xfer.descriptors, "timed out"
            await asyncio.sleep(0.0002)

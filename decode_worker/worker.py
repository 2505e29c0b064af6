"""DecodeWorker: an engine in the decode role. It pulls only the prompt
blocks it lacks from a prefill node (its own prefix cache counts), then
joins the request to its continuous batch. Outputs leave through one
stream per worker: every engine step's deltas as one message.

In colocated mode (or for a conditional local prefill) it prefills itself.
A hand-off can be reserved ahead (`reserve`, while the prefill node still
computes the prompt): the submit that follows then pulls at once and the
request joins at the next step, instead of first waiting a step for its
blocks. A reservation no submit claims in `RESERVATION_TTL_FACTOR` transfer
timeouts is freed (a frontend that vanished). While it is held, the prefill
node may report the prompt blocks it has completed (`read_ahead`, after each
of its engine steps): they are read then, into the reserved blocks, and the
submit reads only the rest (the last chunk's blocks) and any block whose
source changed since (a preemption there recomputed it).
A failed or timed-out pull is recomputed here (`PullFailure.RECOMPUTE`) or
handed back to the frontend to prefill elsewhere (`PullFailure.REPORT`). `drain()`
(scale-down) hands back queued, unstarted requests; submits arriving or still
waiting for KV room while draining come back `moved` (nothing joined here).
A plain class; the launcher wraps it with `ray.remote(...)`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, AsyncIterator

from decode_worker.read_ahead import AheadRead, LayerRange, PendingRead, ReadResult, RestPlan, finished_well, plan_rest
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, QueueFull
from engine.outputs import StepDelta
from engine.sampling_params import SamplingParams
from engine.scheduler import RemoteAllocation
from kvtransfer.engine import PeerInfo, TransferEngine, TransferStatus
from kvtransfer.handle import KVHandle, RankSource
from kvtransfer.head_plan import HeadShard, Segment
from kvtransfer.head_read import HeadReadResult, notify_source, read_heads
from kvtransfer.settings import TransferSettings
from worker_api.base import WorkerBase
from worker_api.messages import PullFailure, ReadyInfo, SubmitResult, WorkerReport, WorkItem
from worker_api.protocol import DecodeWorkerAPI

log = logging.getLogger("pdserve.decode")
RESERVATION_TTL_FACTOR = 6   # an unclaimed reservation lives this many transfer timeouts

class DecodeWorker(WorkerBase):
    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferSettings,
                 torch_threads: int = 1, pool: str = "decode", tp_ranks: Sequence[Any] = ()) -> None:
        super().__init__(worker_id, pool, engine_config, transfer, torch_threads, batch_stream=True,
                         tp_ranks=tp_ranks)
        self.transfer: TransferEngine | None = None if pool == "colocated" else self._open_transfer()
        # one thread owns every transfer-engine call (backends need not be thread-safe)
        self._xfer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-pull")
        self._awaiting_room = 0             # handed-off requests waiting here for KV room
        self._cancelled: set[str] = set()   # aborted while their submit() was still in progress
        self._submitting: set[str] = set()
        self._pulling: set[str] = set()     # blocks allocated and being written by a transfer
        self._reserved: dict[str, RemoteAllocation] = {}   # blocks reserved ahead of a submit
        self._ahead: dict[str, list[PendingRead]] = {}   # reads into reserved blocks before the submit

    def _ready_info(self) -> ReadyInfo:
        info = super()._ready_info()
        return info if self.transfer is None else replace(info, backend=self.transfer.backend_name)

    async def output_stream(self) -> AsyncIterator[list[StepDelta]]:
        """Every engine step's deltas, one list per step (a Ray streaming generator); before a
        step's forward, a list of the `admitted` deltas of hand-offs that step takes in."""
        await self._start()
        yield []   # tells the consumer the stream is up (after a restart, too)
        async for batch in self.aengine.step_batches():
            yield batch

    async def submit(self, *, item: WorkItem, handle: KVHandle | None = None, first_token: int | None = None,
                     on_pull_failure: PullFailure = PullFailure.RECOMPUTE) -> SubmitResult:
        """Join the request: pull the blocks `handle` names that are not cached here
        (`first_token`: the token the prefill node sampled, which a hand-off needs), or,
        without a handle, prefill it here."""
        if not isinstance(on_pull_failure, PullFailure):
            raise ValueError(f"on_pull_failure must be a PullFailure ({', '.join(p.name for p in PullFailure)}), "
                             f"got {on_pull_failure!r}")
        if handle is not None and first_token is None:
            raise ValueError("a hand-off needs the prefill node's first token: pass first_token with the handle "
                             "(PrefillResult.first_token)")
        await self._start()
        if self._draining:
            return SubmitResult(local_prefill=handle is None, joined=False, moved=True, error="draining")
        if handle is None:
            return await self._prefill_here(item)
        assert first_token is not None   # checked above, before anything changed
        self._submitting.add(item.request_id)
        try:
            return await self._pull(item, handle, first_token, on_pull_failure)
        finally:
            self._submitting.discard(item.request_id)
            self._cancelled.discard(item.request_id)

    async def _prefill_here(self, item: WorkItem) -> SubmitResult:
        """No hand-off (after all): queue the prompt to be prefilled by this engine."""
        rid = item.request_id
        reserved = self._reserved.pop(rid, None) is not None   # its reservation goes unused
        await self._settle_ahead(rid)

        def add(e: LLMEngine) -> None:
            if reserved:
                e.abort_request(rid)
            e.add_request(rid, item.prompt_token_ids, item.sampling, item.cache_salt)
        try:
            await self.aengine.call(add)
        except QueueFull as e:
            return SubmitResult(local_prefill=True, joined=False, moved=True, busy=True, error=str(e))
        return SubmitResult(local_prefill=True)

    async def reserve(self, *, item: WorkItem) -> bool:
        """Reserve KV blocks for a prompt a prefill node is computing now, so that the
        `submit` that follows pulls at once. False: nothing reserved (draining, queue
        full, no room now, colocated); the submit then allocates as before."""
        await self._start()
        request_id = item.request_id
        if self._draining or self.transfer is None or request_id in self._reserved:
            return False
        self._submitting.add(request_id)
        try:
            def add(e: LLMEngine) -> RemoteAllocation | None:
                e.check_room(self._awaiting_room)
                return e.add_remote_request(request_id, item.prompt_token_ids, item.sampling, None, item.cache_salt)
            try:
                alloc = await self.aengine.call(add)
            except QueueFull:
                return False
            if alloc is None:
                return False
            if request_id in self._cancelled or self._draining:   # aborted or draining meanwhile
                await self.aengine.call(lambda e: e.abort_request(request_id))
                return False
            self._reserved[request_id] = alloc
            ttl = RESERVATION_TTL_FACTOR * self.settings.timeout
            asyncio.get_running_loop().call_later(ttl, lambda: asyncio.ensure_future(self._expire(request_id, alloc)))
            return True
        finally:
            self._submitting.discard(request_id)
            self._cancelled.discard(request_id)

    async def read_ahead(self, *, request_id: str, peer: PeerInfo, first_index: int,
                         block_ids: tuple[int, ...], preemptions: int, layers: LayerRange | None = None) -> None:
        """The prefill node completed prompt blocks `first_index`.. (its `block_ids`), or
        only their `layers` [l0, l1) (the last chunk, while it computes): read them now into
        the reservation. Ignored without one (not made yet, or already claimed), or for layers
        this transfer backend cannot read apart: the submit then reads them."""
        alloc = self._reserved.get(request_id)
        if alloc is None or self.tp_actors:   # a TP worker reads every rank's heads at the submit
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

    async def _settle_ahead(self, request_id: str) -> list[PendingRead]:
        """Wait for the reads into `request_id`'s reserved blocks: before the blocks are
        freed or handed to the engine, nothing may still write into them."""
        reads = self._ahead.pop(request_id, [])
        if reads:
            await asyncio.gather(*(r.task for r in reads), return_exceptions=True)
        return reads

    async def _expire(self, request_id: str, alloc: RemoteAllocation) -> None:
        if self._reserved.get(request_id) is alloc:   # never claimed: its frontend is gone
            del self._reserved[request_id]
            log.warning("reservation of %s was not claimed in time: freeing its blocks", request_id)
            await self._settle_ahead(request_id)
            await self.aengine.call(lambda e: e.abort_request(request_id))

    async def drain(self) -> list[str]:
        """Scale-down: take no new requests; free reservations; abort and return the
        queued, unstarted requests."""
        self._draining = True
        reserved = list(self._reserved)
        self._reserved.clear()
        for rid in reserved:
            await self._settle_ahead(rid)
        # the reserved ones' submits come back `moved` and are routed elsewhere
        return await self._stop_taking_work(abort_first=reserved)

    async def _pull(self, item: WorkItem, handle: KVHandle, first_token: int,
                    on_pull_failure: PullFailure) -> SubmitResult:
        request_id, prompt_token_ids, params, cache_salt = (item.request_id, item.prompt_token_ids,
                                                            item.sampling, item.cache_salt)
        t_arrived = deadline = time.monotonic()
        deadline += self.settings.timeout
        first = True
        alloc = self._reserved.pop(request_id, None)
        # the first token reaches the engine with the allocation, or (reserved ahead) with the KV
        late_token = first_token if alloc is not None else None

        def add(e: LLMEngine) -> RemoteAllocation | None:
            if first:   # a new arrival counts against the queue bound; a retry is already in it
                e.check_room(self._awaiting_room)
            return e.add_remote_request(request_id, prompt_token_ids, params, first_token, cache_salt)

        try:
            while alloc is None:
                if request_id in self._cancelled:
                    return SubmitResult(local_prefill=False, error="aborted before its KV arrived")
                if self._draining:   # still queued for KV room: nothing joined, the lease is still good
                    return SubmitResult(local_prefill=False, joined=False, moved=True, error="draining")
                try:
                    alloc = await self.aengine.call(add)
                except QueueFull as e:   # nothing joined, the lease is still good
                    return SubmitResult(local_prefill=False, joined=False, moved=True, busy=True, error=str(e))
                if alloc is not None:
                    break
                if first:
                    first = False
                    self._awaiting_room += 1
                if time.monotonic() > deadline:   # no room: queue as a local recompute instead
                    await self.aengine.call(lambda e: _add_with_first_token(
                        e, request_id, prompt_token_ids, params, cache_salt, first_token))
                    return SubmitResult(local_prefill=True, recomputed=True, error="no free KV blocks in time")
                await asyncio.sleep(0.005)
        finally:
            if not first:
                self._awaiting_room -= 1
        t0 = time.monotonic()
        room_wait = t0 - t_arrived
        status, nbytes, ndesc, err = TransferStatus.DONE, 0, 0, ""
        self._pulling.add(request_id)   # from here only this call frees the blocks (see abort)
        try:
            plan = self._rest_plan(await self._settle_ahead(request_id), handle, alloc)
            if request_id in self._cancelled:   # aborted while its blocks were being allocated
                await self.aengine.call(lambda e: e.abort_request(request_id))
                return SubmitResult(local_prefill=False, error="aborted before its KV arrived", joined=False)
            status, nbytes, ndesc, err = await self._read_rest(handle, alloc, plan, request_id.encode())
        finally:
            self._pulling.discard(request_id)
        seconds = time.monotonic() - t0
        if self.transfer is not None:
            nbytes += plan.ahead_layers * (self.transfer.layout.block_transfer_bytes // self.kv_heads.num_layers)
        if request_id in self._cancelled:   # freed only now: the transfer no longer writes into them
            await self.aengine.call(lambda e: e.abort_request(request_id))
            return SubmitResult(local_prefill=False, error="aborted while its KV arrived", joined=False)
        if status is TransferStatus.DONE:
            await self.aengine.call(lambda e: e.remote_kv_ready(request_id, late_token))
            return SubmitResult(local_prefill=False, cached_blocks=alloc.num_cached_blocks,
                                transferred_blocks=plan.blocks, transferred_bytes=nbytes,
                                descriptors=ndesc, transfer_seconds=seconds, block_ids=tuple(alloc.block_ids),
                                room_wait_seconds=room_wait, reserved=late_token is not None,
                                read_ahead_blocks=plan.ahead_blocks, layer_read_ahead_blocks=plan.layer_blocks)
        if on_pull_failure is PullFailure.REPORT:
            log.warning("KV pull of %s failed (%s): handing it back", request_id, err or status.value)
            await self.aengine.call(lambda e: e.abort_request(request_id))
            return SubmitResult(local_prefill=False, cached_blocks=alloc.num_cached_blocks, descriptors=ndesc,
                                transfer_seconds=seconds, joined=False, error=err or status.value)
        log.warning("KV pull of %s failed (%s): recomputing locally", request_id, err or status.value)
        await self.aengine.call(lambda e: e.remote_kv_failed(request_id, late_token))
        return SubmitResult(local_prefill=False, cached_blocks=alloc.num_cached_blocks, descriptors=ndesc,
                            transfer_seconds=seconds, recomputed=True, error=err or status.value)

    def _rest_plan(self, pending: list[PendingRead], handle: KVHandle, alloc: RemoteAllocation) -> RestPlan:
        """What the submit still reads, after the reads ahead (decode_worker/read_ahead.py)."""
        return plan_rest(finished_well(pending), source=(handle.peer.agent_name, handle.peer.incarnation),
                         preemptions=handle.preemptions, src_blocks=handle.block_ids,
                         first=alloc.num_cached_blocks, end=len(alloc.block_ids), num_layers=self.kv_heads.num_layers)

    async def _read_rest(self, handle: KVHandle, alloc: RemoteAllocation, plan: RestPlan, notify: bytes) -> ReadResult:
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

    async def _read_handle(self, handle: KVHandle, src: list[int], dst: list[int], notify: bytes) -> ReadResult:
        """Read the handle's blocks `src` into ours `dst`; across tensor-parallel ranks when
        either side splits the KV heads (every rank reads its heads, then rank 0 notifies)."""
        if not handle.tensor_parallel and not self.tp_actors:
            return await self._read(handle.peer, src, dst, notify)
        transfer = self.transfer
        if transfer is None:
            return TransferStatus.FAILED, 0, 0, "a colocated worker moves no KV: submit it without a handle"
        sources = handle.ranks or (RankSource(handle.peer, HeadShard(0, self.kv_heads.num_kv_heads)),)
        heads, timeout = self.kv_heads, self.settings.timeout
        loop = asyncio.get_running_loop()
        own = loop.run_in_executor(self._xfer_thread, lambda: read_heads(
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
        note = await loop.run_in_executor(self._xfer_thread, lambda: notify_source(
            transfer, handle.peer, notify, timeout))
        return note.status, nbytes, ndesc + note.descriptors, note.error

    async def _read(self, peer: PeerInfo, src: list[int], dst: list[int], notify: bytes,
                    segments: list[Segment] | None = None) -> ReadResult:
        """Read `peer`'s blocks `src` into ours `dst` (only the byte `segments` of each, if
        given): (status, bytes, descriptors, error). `notify` (the request id) tells the
        source the read is done: its lease ends."""
        transfer = self.transfer
        if transfer is None:   # colocated: nothing to read with; the caller recomputes or reports
            return TransferStatus.FAILED, 0, 0, "a colocated worker moves no KV: submit it without a handle"
        loop = asyncio.get_running_loop()
        try:
            xfer = await loop.run_in_executor(self._xfer_thread, lambda: transfer.read(
                peer, src, dst, notify=notify) if segments is None else transfer.read_segments(
                peer, src, dst, segments, notify=notify))
        except Exception as e:   # peer unreachable / gone
            return TransferStatus.FAILED, 0, 0, f"{type(e).__name__}: {e}"
        deadline = time.monotonic() + self.settings.timeout
        while True:
            status = await loop.run_in_executor(self._xfer_thread, xfer.poll)
            if status is not TransferStatus.PENDING:
                return status, xfer.nbytes, xfer.descriptors, xfer.error or ""
            if time.monotonic() > deadline:
                await loop.run_in_executor(self._xfer_thread, xfer.abandon)
                return TransferStatus.TIMEOUT, 0, xfer.descriptors, "timed out"
            await asyncio.sleep(0.0002)

    async def abort(self, *, request_id: str) -> bool:
        if request_id in self._submitting:
            self._cancelled.add(request_id)
        if request_id in self._pulling:   # a transfer still writes into its blocks: _pull frees them after
            return True
        self._reserved.pop(request_id, None)
        await self._settle_ahead(request_id)   # reads ahead into its blocks end first
        return await self.aengine.call(lambda e: e.abort_request(request_id))

    async def report(self) -> WorkerReport:
        """The engine's report; `stats.waiting` also counts hand-offs still waiting
        here for KV room: they are queued on this node (and count against its
        queue bound), so the router and the waiting-requests gauge see them."""
        report = await super().report()
        if not self._awaiting_room:
            return report
        return replace(report, stats=replace(report.stats, waiting=report.stats.waiting + self._awaiting_room))


def _add_with_first_token(engine: LLMEngine, request_id: str, prompt: tuple[int, ...], params: SamplingParams,
                          salt: str | None, first_token: int) -> None:
    """Recompute locally: the prefill node's first token was already streamed,
    so it joins the prompt and one fewer token is generated."""
    if params.max_tokens > 1:
        params = replace(params, max_tokens=params.max_tokens - 1)
    engine.add_request(request_id, list(prompt) + [first_token], params, salt, bounded=False)


def _implements_api(worker: DecodeWorker) -> DecodeWorkerAPI:
    return worker   # mypy checks here that DecodeWorker implements the protocol

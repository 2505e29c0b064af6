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
A failed or timed-out pull is recomputed here (`on_pull_failure="recompute"`)
or handed back to the frontend to prefill elsewhere (`"report"`). `drain()`
(scale-down) hands back queued, unstarted requests; submits arriving or still
waiting for KV room while draining come back `moved` (nothing joined here).
A plain class; the launcher wraps it with `ray.remote(...)`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import time
from dataclasses import dataclass, replace

from engine.async_engine import AsyncEngine, WorkerReport
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, QueueFull
from engine.sampling_params import SamplingParams
from engine.scheduler import RemoteAllocation
from kvtransfer.engine import TransferStatus
from kvtransfer.handle import KVHandle
from kvtransfer.layout import KVPoolLayout
from kvtransfer.settings import TransferSettings

log = logging.getLogger("pdserve.decode")
PULL_FAILURE_ACTIONS = ("recompute", "report")
RESERVATION_TTL_FACTOR = 6   # an unclaimed reservation lives this many transfer timeouts


@dataclass(frozen=True)
class SubmitResult:
    """How the request joined this worker. `transferred_blocks` is 0 for a
    local prefill; `recomputed` is True when a pull failed and the prompt is
    being recomputed here."""
    local_prefill: bool
    cached_blocks: int = 0
    transferred_blocks: int = 0
    transferred_bytes: int = 0
    descriptors: int = 0
    transfer_seconds: float = 0.0
    recomputed: bool = False
    error: str = ""
    joined: bool = True      # False: not in this engine (pull failed with "report", or moved)
    moved: bool = False      # the worker is draining: submit it elsewhere (the handle is still good)
    busy: bool = False       # with `moved`: its queue was full (SchedulerConfig.max_waiting)
    block_ids: tuple[int, ...] = ()   # the request's blocks here after the pull (for explaining it)
    room_wait_seconds: float = 0.0    # waiting here for free KV blocks before the pull
    reserved: bool = False            # its blocks were reserved ahead (`reserve`): no wait for room
    read_ahead_blocks: int = 0        # of transferred_blocks: read while the prompt was prefilled


@dataclass(frozen=True)
class _AheadRead:
    """Blocks read before the submit: prompt block `indices`, from the source's
    `src` blocks as of its `preemptions` count; `task` gives the TransferStatus."""
    source: tuple[str, str]    # the peer's (agent name, incarnation)
    indices: tuple[int, ...]
    src: tuple[int, ...]
    preemptions: int
    task: asyncio.Task


class DecodeWorker:
    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferSettings,
                 torch_threads: int = 1, pool: str = "decode") -> None:
        import torch

        torch.set_num_threads(max(1, torch_threads))
        self.worker_id = worker_id
        self.pool = pool
        if not transfer.host:   # a cluster's settings: bind this worker's own node address
            transfer = transfer.on_node(_node_address())
        self.settings = transfer
        self.engine = LLMEngine(engine_config)
        self.aengine = AsyncEngine(self.engine, batch_stream=True)
        self.transfer = None
        if pool != "colocated":
            self.transfer = transfer.create(worker_id)
            self.transfer.register_pool(KVPoolLayout.from_tensor(self.engine.kv_pool.tensor))
        # one thread owns every transfer-engine call (backends need not be thread-safe)
        self._xfer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-pull")
        self._draining = False
        self._awaiting_room = 0             # handed-off requests waiting here for KV room
        self._cancelled: set[str] = set()   # aborted while their submit() was still in progress
        self._submitting: set[str] = set()
        self._pulling: set[str] = set()     # blocks allocated and being written by a transfer
        self._reserved: dict[str, RemoteAllocation] = {}   # blocks reserved ahead of a submit
        self._ahead: dict[str, list[_AheadRead]] = {}   # reads into reserved blocks before the submit

    async def ready(self) -> dict:
        await self.aengine.start()
        return {"worker_id": self.worker_id, "pid": os.getpid(), "niceness": os.nice(0),
                "address": self.settings.host, "hostname": socket.gethostname(), "pool": self.pool,
                "num_blocks": self.engine.kv_pool.num_blocks, "block_size": self.engine.block_size,
                "kv_cache_dtype": self.engine.kv_pool.kv_cache_dtype,
                "kv_bytes_per_block": self.engine.kv_pool.bytes_per_block}

    async def output_stream(self):
        """Every engine step's deltas, one list per step (a Ray streaming generator)."""
        await self.ready()
        yield []   # tells the consumer the stream is up (after a restart, too)
        async for batch in self.aengine.step_batches():
            yield batch

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     cache_salt: str | None = None, handle: KVHandle | None = None,
                     on_pull_failure: str = "recompute") -> SubmitResult:
        if on_pull_failure not in PULL_FAILURE_ACTIONS:
            raise ValueError(f"on_pull_failure must be one of {PULL_FAILURE_ACTIONS}, got {on_pull_failure!r}")
        await self.ready()
        if self._draining:
            return SubmitResult(local_prefill=handle is None, joined=False, moved=True, error="draining")
        if handle is None:
            reserved = self._reserved.pop(request_id, None) is not None   # no hand-off after all
            await self._settle_ahead(request_id)

            def add(e: LLMEngine) -> None:
                if reserved:
                    e.abort_request(request_id)
                e.add_request(request_id, prompt_token_ids, params, cache_salt)
            try:
                await self.aengine.call(add)
            except QueueFull as e:
                return SubmitResult(local_prefill=True, joined=False, moved=True, busy=True, error=str(e))
            return SubmitResult(local_prefill=True)
        self._submitting.add(request_id)
        try:
            return await self._pull(request_id, prompt_token_ids, params, cache_salt, handle, on_pull_failure)
        finally:
            self._submitting.discard(request_id)
            self._cancelled.discard(request_id)

    async def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      cache_salt: str | None = None) -> bool:
        """Reserve KV blocks for a prompt a prefill node is computing now, so that the
        `submit` that follows pulls at once. False: nothing reserved (draining, queue
        full, no room now, colocated); the submit then allocates as before."""
        await self.ready()
        if self._draining or self.transfer is None or request_id in self._reserved:
            return False
        self._submitting.add(request_id)
        try:
            def add(e: LLMEngine):
                e.check_room(self._awaiting_room)
                return e.add_remote_request(request_id, prompt_token_ids, params, None, cache_salt)
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

    async def read_ahead(self, request_id: str, peer, first_index: int, block_ids: tuple[int, ...],
                         preemptions: int) -> None:
        """The prefill node completed prompt blocks `first_index`.. (its `block_ids`):
        read them now into the reservation. Ignored without one (not made yet, or
        already claimed): the submit then reads them."""
        alloc = self._reserved.get(request_id)
        if alloc is None:
            return
        end = min(first_index + len(block_ids), len(alloc.block_ids))
        indices = tuple(range(max(first_index, alloc.num_cached_blocks), end))
        if not indices:
            return
        src = tuple(block_ids[i - first_index] for i in indices)
        task = asyncio.get_running_loop().create_task(
            self._read(peer, list(src), [alloc.block_ids[i] for i in indices], b""))
        self._ahead.setdefault(request_id, []).append(
            _AheadRead((peer.agent_name, peer.incarnation), indices, src, preemptions, task))

    async def _settle_ahead(self, request_id: str) -> list[_AheadRead]:
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
        from prefill_worker.worker import abort_unstarted

        self._draining = True
        reserved = list(self._reserved)
        self._reserved.clear()
        for rid in reserved:
            await self._settle_ahead(rid)

        def drain_engine(e: LLMEngine) -> list[str]:
            for rid in reserved:   # their submits come back `moved` and are routed elsewhere
                e.abort_request(rid)
            return abort_unstarted(e)
        return await self.aengine.call(drain_engine)

    def undrain(self) -> None:
        self._draining = False

    async def _pull(self, request_id, prompt_token_ids, params, cache_salt, handle: KVHandle,
                    on_pull_failure: str) -> SubmitResult:
        t_arrived = deadline = time.monotonic()
        deadline += self.settings.timeout
        first = True
        alloc = self._reserved.pop(request_id, None)
        # the first token reaches the engine with the allocation, or (reserved ahead) with the KV
        late_token = handle.first_token if alloc is not None else None

        def add(e: LLMEngine):
            if first:   # a new arrival counts against the queue bound; a retry is already in it
                e.check_room(self._awaiting_room)
            return e.add_remote_request(request_id, prompt_token_ids, params, handle.first_token, cache_salt)

        try:
            while alloc is None:
                if request_id in self._cancelled:
                    return SubmitResult(False, error="aborted before its KV arrived")
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
                        e, request_id, prompt_token_ids, params, cache_salt, handle.first_token))
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
            ahead = _read_ahead_blocks(await self._settle_ahead(request_id), handle)
            if request_id in self._cancelled:   # aborted while its blocks were being allocated
                await self.aengine.call(lambda e: e.abort_request(request_id))
                return SubmitResult(False, error="aborted before its KV arrived", joined=False)
            todo = [i for i in range(alloc.num_cached_blocks, len(alloc.block_ids))
                    if ahead.get(i, (None,))[0] != handle.block_ids[i]]
            if ahead and not todo:   # the last read carries the notification that ends the source's lease
                todo = [len(alloc.block_ids) - 1]
            if todo:
                status, nbytes, ndesc, err = await self._read(
                    handle.peer, [handle.block_ids[i] for i in todo], [alloc.block_ids[i] for i in todo],
                    request_id.encode())
        finally:
            self._pulling.discard(request_id)
        seconds = time.monotonic() - t0
        reread = set(todo)
        read_ahead = sum(1 for i in ahead if i not in reread)
        nbytes += sum(nb for i, (_, nb) in ahead.items() if i not in reread)
        if request_id in self._cancelled:   # freed only now: the transfer no longer writes into them
            await self.aengine.call(lambda e: e.abort_request(request_id))
            return SubmitResult(False, error="aborted while its KV arrived", joined=False)
        if status is TransferStatus.DONE:
            await self.aengine.call(lambda e: e.remote_kv_ready(request_id, late_token))
            return SubmitResult(False, alloc.num_cached_blocks, len(todo) + read_ahead, nbytes, ndesc, seconds,
                                block_ids=tuple(alloc.block_ids), room_wait_seconds=room_wait,
                                reserved=late_token is not None, read_ahead_blocks=read_ahead)
        if on_pull_failure == "report":
            log.warning("KV pull of %s failed (%s): handing it back", request_id, err or status.value)
            await self.aengine.call(lambda e: e.abort_request(request_id))
            return SubmitResult(False, alloc.num_cached_blocks, 0, 0, ndesc, seconds, joined=False,
                                error=err or status.value)
        log.warning("KV pull of %s failed (%s): recomputing locally", request_id, err or status.value)
        await self.aengine.call(lambda e: e.remote_kv_failed(request_id, late_token))
        return SubmitResult(False, alloc.num_cached_blocks, 0, 0, ndesc, seconds, recomputed=True,
                            error=err or status.value)

    async def _read(self, peer, src: list[int], dst: list[int], notify: bytes):
        """Read `peer`'s blocks `src` into ours `dst`: (status, bytes, descriptors, error).
        `notify` (the request id) tells the source the read is done: its lease ends."""
        loop = asyncio.get_running_loop()
        try:
            xfer = await loop.run_in_executor(self._xfer_thread, lambda: self.transfer.read(
                peer, src, dst, notify=notify))
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

    async def abort(self, request_id: str) -> bool:
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
        report = await self.aengine.report(self.worker_id, self.pool)
        if not self._awaiting_room:
            return report
        return replace(report, stats=replace(report.stats, waiting=report.stats.waiting + self._awaiting_room))

    def step_trace(self) -> dict:
        """Steps timed since the last call (step_trace_size > 0): see engine/step_trace.py."""
        return {"worker_id": self.worker_id, **self.aengine.step_trace()}

    async def kv_snapshot(self):
        return await self.aengine.call(lambda e: e.kv_snapshot())

    async def check_integrity(self) -> dict:
        stats = await self.aengine.call(lambda e: (e.check_integrity(), e.stats())[1])
        return {"kv_blocks_used": stats.kv_blocks_used, "running": stats.running, "waiting": stats.waiting}



def _read_ahead_blocks(reads: list[_AheadRead], handle: KVHandle) -> dict[int, tuple[int, int]]:
    """Prompt block index -> (source block, bytes) of the blocks read ahead that are
    still good: read in full, from the handle's source at its final preemption count."""
    good: dict[int, tuple[int, int]] = {}
    source = (handle.peer.agent_name, handle.peer.incarnation)
    for r in reads:
        if r.source != source or r.preemptions != handle.preemptions:
            continue
        if r.task.cancelled() or r.task.exception() is not None:
            continue
        status, nbytes, _, _ = r.task.result()
        if status is TransferStatus.DONE:
            for i, src in zip(r.indices, r.src):
                good[i] = (src, nbytes // len(r.indices))
    return good

def _add_with_first_token(engine: LLMEngine, request_id, prompt, params, salt, first_token) -> None:
    """Recompute locally: the prefill node's first token was already streamed,
    so it joins the prompt and one fewer token is generated."""
    if params.max_tokens > 1:
        params = replace(params, max_tokens=params.max_tokens - 1)
    engine.add_request(request_id, list(prompt) + [first_token], params, salt, bounded=False)


def _node_address() -> str:
    """The address of the Ray node this worker runs on (what peers on other machines reach)."""
    import ray
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"

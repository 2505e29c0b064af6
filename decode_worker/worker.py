"""DecodeWorker: an engine in the decode role. It pulls only the prompt
blocks it lacks from a prefill node (its own prefix cache counts), then
joins the request to its continuous batch. Outputs leave through one
stream per worker: every engine step's deltas as one message.

In colocated mode (or for a conditional local prefill) it prefills itself.
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
from kvtransfer.engine import TransferStatus
from kvtransfer.handle import KVHandle
from kvtransfer.layout import KVPoolLayout
from kvtransfer.settings import TransferSettings

log = logging.getLogger("pdserve.decode")
PULL_FAILURE_ACTIONS = ("recompute", "report")


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
            try:
                await self.aengine.call(lambda e: e.add_request(request_id, prompt_token_ids, params, cache_salt))
            except QueueFull as e:
                return SubmitResult(local_prefill=True, joined=False, moved=True, busy=True, error=str(e))
            return SubmitResult(local_prefill=True)
        self._submitting.add(request_id)
        try:
            return await self._pull(request_id, prompt_token_ids, params, cache_salt, handle, on_pull_failure)
        finally:
            self._submitting.discard(request_id)
            self._cancelled.discard(request_id)

    async def drain(self) -> list[str]:
        """Scale-down: take no new requests; abort and return the queued, unstarted ones."""
        from prefill_worker.worker import abort_unstarted

        self._draining = True
        return await self.aengine.call(abort_unstarted)

    def undrain(self) -> None:
        self._draining = False

    async def _pull(self, request_id, prompt_token_ids, params, cache_salt, handle: KVHandle,
                    on_pull_failure: str) -> SubmitResult:
        deadline = time.monotonic() + self.settings.timeout
        first = True

        def add(e: LLMEngine):
            if first:   # a new arrival counts against the queue bound; a retry is already in it
                e.check_room(self._awaiting_room)
            return e.add_remote_request(request_id, prompt_token_ids, params, handle.first_token, cache_salt)

        try:
            while True:
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
        if request_id in self._cancelled:   # aborted while its blocks were being allocated
            await self.aengine.call(lambda e: e.abort_request(request_id))
            return SubmitResult(False, error="aborted before its KV arrived", joined=False)
        src = handle.block_ids[alloc.num_cached_blocks:len(alloc.block_ids)]
        dst = alloc.blocks_to_pull
        t0 = time.monotonic()
        status, nbytes, ndesc, err = TransferStatus.DONE, 0, 0, ""
        self._pulling.add(request_id)
        try:
            if dst:
                status, nbytes, ndesc, err = await self._read(handle, list(src), list(dst), request_id)
            elif handle.block_ids:   # nothing to read: tell the source its lease can go
                status = TransferStatus.DONE
        finally:
            self._pulling.discard(request_id)
        seconds = time.monotonic() - t0
        if request_id in self._cancelled:   # freed only now: the transfer no longer writes into them
            await self.aengine.call(lambda e: e.abort_request(request_id))
            return SubmitResult(False, error="aborted while its KV arrived", joined=False)
        if status is TransferStatus.DONE:
            await self.aengine.call(lambda e: e.remote_kv_ready(request_id))
            return SubmitResult(False, alloc.num_cached_blocks, len(dst), nbytes, ndesc, seconds,
                                block_ids=tuple(alloc.block_ids))
        if on_pull_failure == "report":
            log.warning("KV pull of %s failed (%s): handing it back", request_id, err or status.value)
            await self.aengine.call(lambda e: e.abort_request(request_id))
            return SubmitResult(False, alloc.num_cached_blocks, 0, 0, ndesc, seconds, joined=False,
                                error=err or status.value)
        log.warning("KV pull of %s failed (%s): recomputing locally", request_id, err or status.value)
        await self.aengine.call(lambda e: e.remote_kv_failed(request_id))
        return SubmitResult(False, alloc.num_cached_blocks, 0, 0, ndesc, seconds, recomputed=True,
                            error=err or status.value)

    async def _read(self, handle: KVHandle, src: list[int], dst: list[int], request_id: str):
        loop = asyncio.get_running_loop()
        try:
            xfer = await loop.run_in_executor(self._xfer_thread, lambda: self.transfer.read(
                handle.peer, src, dst, notify=request_id.encode()))
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

"""PrefillWorker: an engine in the prefill role, its KV pool registered for
remote reads, and a lease table that frees every handed-off block exactly
once (read notification, explicit release, or expiry). The frontend renews
a lease while the decode node still waits for KV room (`renew`). `drain()`
(scale-down) hands back the requests still queued here, unstarted, so the
frontend can prefill them elsewhere.

Pipelined hand-off: given `read_ahead` (the decode worker that reserved the
prompt's blocks), the worker tells it after every engine step that computed
a chunk which prompt blocks are complete (the engine's tokenless
`StepDelta.computed_block_ids`), so it reads them while the next chunk
computes; only the last chunk's blocks are left for the read after the
first token.

A plain class: the cluster launcher wraps it with `ray.remote(...)` and the
resources of its pool, so it also runs in-process for tests.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass, replace

from engine.async_engine import AsyncEngine, WorkerReport
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, QueueFull
from engine.outputs import StepDelta
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from kvtransfer.handle import KVHandle
from kvtransfer.layout import KVPoolLayout
from kvtransfer.leases import Lease, LeaseTable, ReleaseCause
from kvtransfer.settings import TransferSettings

log = logging.getLogger("pdserve.prefill")


@dataclass(frozen=True)
class PrefillResult:
    """The first token's delta, and the KV handle unless that token ended the request.
    `moved`: the worker did not start it (`first` is None): prefill elsewhere. It is
    draining, or (`busy`) its queue is full."""
    first: StepDelta | None
    handle: KVHandle | None
    queue_seconds: float
    prefill_seconds: float
    moved: bool = False
    busy: bool = False   # with `moved`: its queue was full (SchedulerConfig.max_waiting)


@dataclass(frozen=True)
class LeaseCounters:
    active: int
    expired: int
    notified: int
    released: int
    pinned: int = 0      # ever pinned: pinned == active + expired + notified + released
    renewed: int = 0


class PrefillWorker:
    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferSettings,
                 torch_threads: int = 1) -> None:
        import torch

        torch.set_num_threads(max(1, torch_threads))
        self.worker_id = worker_id
        if not transfer.host:   # a cluster's settings: bind this worker's own node address
            transfer = transfer.on_node(_node_address())
        self.settings = transfer
        self.engine = LLMEngine(engine_config)
        self.aengine = AsyncEngine(self.engine)
        self.transfer = transfer.create(worker_id)
        self.transfer.register_pool(KVPoolLayout.from_tensor(self.engine.kv_pool.tensor))
        # a source that sees its reads refuses those of ended leases; one that does not
        # (one-sided NIXL reads) keeps an expired lease's blocks a transfer timeout longer
        grace = 0.0 if self.transfer.sees_reads else transfer.timeout
        self.leases = LeaseTable(time.monotonic, self._on_lease_end, expiry_grace=grace)
        self.transfer.set_read_guard(self.leases)
        self._maintenance: asyncio.Task | None = None
        self._pending: dict[str, asyncio.Queue] = {}   # request id -> queue, while prefilling
        self._draining = False
        self._fired: set[asyncio.Task] = set()   # read_ahead messages sent in this process

    # ------------------------------------------------------------- control
    async def ready(self) -> dict:
        await self.aengine.start()
        if self._maintenance is None:
            self._maintenance = asyncio.get_running_loop().create_task(self._maintain())
        return {"worker_id": self.worker_id, "pid": os.getpid(), "niceness": os.nice(0),
                "address": self.settings.host, "hostname": socket.gethostname(),
                "backend": self.transfer.backend_name, "kv_port": self.transfer.peer_info().port,
                "num_blocks": self.engine.kv_pool.num_blocks, "block_size": self.engine.block_size,
                "kv_cache_dtype": self.engine.kv_pool.kv_cache_dtype,
                "kv_bytes_per_block": self.engine.kv_pool.bytes_per_block}

    def peer_info(self):
        return self.transfer.peer_info()

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      cache_salt: str | None = None, read_ahead=None) -> PrefillResult:
        """Compute the prompt's KV and its first token; pin the blocks for a reader.
        `read_ahead`: a decode worker (a Ray actor handle, or the object itself) whose
        `read_ahead(request_id, peer, first_index, block_ids, preemptions)` is told of
        the prompt blocks completed since it was last told, after every chunk's step
        (all of them again after a preemption). Best effort: a message lost or late
        only means those blocks are read after the first token."""
        await self.ready()
        t0 = time.monotonic()
        if self._draining:
            return PrefillResult(None, None, 0.0, 0.0, moved=True)
        queue = self.aengine.subscribe(request_id)
        self._pending[request_id] = queue
        try:
            try:
                await self.aengine.call(lambda e: e.add_request(request_id, prompt_token_ids, params,
                                                                cache_salt, prefill_only=True))
            except QueueFull:
                return PrefillResult(None, None, 0.0, 0.0, moved=True, busy=True)
            told, epoch = 0, 0   # blocks told to the reader, at the preemption count `epoch`
            while True:
                first: StepDelta | None = await queue.get()
                if first is None or first.new_token_ids:
                    break
                if read_ahead is None:   # a chunk's progress: only a pipelined hand-off wants it
                    continue
                if first.preemptions != epoch:
                    told, epoch = 0, first.preemptions
                blocks = first.computed_block_ids
                if len(blocks) > told:
                    with contextlib.suppress(Exception):   # the reader is gone: its submit says so
                        self._fire(read_ahead.read_ahead, request_id, self.transfer.peer_info(), told,
                                   blocks[told:], epoch)
                    told = len(blocks)
        except BaseException:
            await self.aengine.call(lambda e: e.abort_request(request_id))
            raise
        finally:
            self.aengine.unsubscribe(request_id)
            self._pending.pop(request_id, None)
        if first is None:   # drain() took it back before it started (or release() ended it)
            return PrefillResult(None, None, 0.0, 0.0, moved=True)
        t1 = time.monotonic()
        # the blocks come with the token (StepDelta.held_block_ids): asking the engine thread
        # would wait for the step it is running, adding a whole prefill step to the TTFT
        block_ids = list(first.held_block_ids)
        handle = None
        if first.finish_reason:       # the first token ended it: nobody will read the KV
            self.aengine.post(lambda e: e.release_held(request_id))    # not on the TTFT path
        else:
            self.leases.pin(request_id, block_ids, self.settings.lease_ttl)
            handle = KVHandle(request_id, self.transfer.peer_info(), tuple(block_ids), len(prompt_token_ids),
                              first.new_token_ids[0], self.settings.lease_ttl, first.preemptions)
        return PrefillResult(first, handle, queue_seconds=0.0, prefill_seconds=t1 - t0)

    async def release(self, request_id: str) -> bool:
        """The decode side will not read (cancelled, or it recomputed): free now."""
        if self.leases.release(request_id, ReleaseCause.RELEASED):
            return True
        pending = self._pending.get(request_id)
        if pending is not None:      # still prefilling: end the waiting prefill() call too
            pending.put_nowait(None)
        return await self.aengine.call(lambda e: e.abort_request(request_id))

    async def abort(self, request_id: str) -> bool:
        return await self.release(request_id)

    def renew(self, request_id: str, ttl: float | None = None) -> bool:
        """The reader still waits (queued for KV room): keep the blocks pinned
        `ttl` (default lease_ttl) seconds from now. False if the lease is gone."""
        return self.leases.renew(request_id, ttl or self.settings.lease_ttl)

    async def drain(self) -> list[str]:
        """Scale-down: accept no new prefills and hand back the queued, unstarted
        ones (their prefill() returns `moved`). Running prefills finish."""
        self._draining = True
        moved = await self.aengine.call(abort_unstarted)
        for rid in moved:
            q = self._pending.get(rid)
            if q is not None:
                q.put_nowait(None)
        return moved

    def undrain(self) -> None:
        self._draining = False

    # ----------------------------------------------------------- reporting
    async def report(self) -> WorkerReport:
        report = await self.aengine.report(self.worker_id, "prefill")
        return replace(report, leases_active=len(self.leases),
                       lease_expiries=self.leases.releases[ReleaseCause.EXPIRED])

    def step_trace(self) -> dict:
        """Steps timed since the last call (step_trace_size > 0): see engine/step_trace.py."""
        return {"worker_id": self.worker_id, **self.aengine.step_trace()}

    async def kv_snapshot(self):
        return await self.aengine.call(lambda e: e.kv_snapshot())

    def lease_counters(self) -> LeaseCounters:
        r = self.leases.releases
        return LeaseCounters(len(self.leases), r[ReleaseCause.EXPIRED], r[ReleaseCause.NOTIFIED],
                             r[ReleaseCause.RELEASED], self.leases.pins, self.leases.renewals)

    async def check_integrity(self) -> dict:
        """Raise if the engine's pools are inconsistent; return block usage."""
        stats = await self.aengine.call(lambda e: (e.check_integrity(), e.stats())[1])
        return {"kv_blocks_used": stats.kv_blocks_used, "held": stats.held, "leases": len(self.leases)}

    # ------------------------------------------------------------- internal
    def _fire(self, method, *args) -> None:
        """Call without waiting: a Ray actor method's `.remote`, or (one process) a
        coroutine method scheduled on this loop."""
        if hasattr(method, "remote"):
            method.remote(*args)
            return
        task = asyncio.get_running_loop().create_task(method(*args))
        self._fired.add(task)
        task.add_done_callback(self._fired.discard)

    def _on_lease_end(self, lease: Lease, cause: ReleaseCause) -> None:
        # may run on any thread: hand the free to the engine thread
        self.aengine.post(lambda e: e.release_held(lease.request_id))
        if cause is ReleaseCause.EXPIRED:
            log.warning("lease of %s expired unread: %d blocks freed", lease.request_id, len(lease.block_ids))

    async def _maintain(self) -> None:
        """Read notifications (this also progresses a passive transfer side) and expire leases."""
        while True:
            try:
                for note in self.transfer.get_notifications():
                    self.leases.release_by_notification(note.message)
                self.leases.expire_due()
            except Exception:  # keep the worker alive; the lease expiry is the backstop
                log.exception("prefill maintenance")
            await asyncio.sleep(0.001)


def abort_unstarted(engine: LLMEngine) -> list[str]:
    """On the engine thread: abort the n == 1 requests still queued with nothing
    computed (no token produced here) and return their ids."""
    ids = [r.request_id for r in engine.scheduler.waiting
           if r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 and r.sampling_params.n == 1]
    for rid in ids:
        engine.abort_request(rid)
    return ids


def _node_address() -> str:
    """The address of the Ray node this worker runs on (what peers on other machines reach)."""
    import ray
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


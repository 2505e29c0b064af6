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
first token. With the engine's `prompt_layer_groups` > 1 the engine also
reports the last chunk's layers group by group during its forward
(`StepDelta.computed_layers`): each group's byte range of those blocks goes to
the reader at once, so only the last layer group is left for the read after the
first token (a layer-wise hand-off).

A plain class: the cluster launcher wraps it with `ray.remote(...)` and the
resources of its pool, so it also runs in-process for tests.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import QueueFull
from engine.outputs import StepDelta
from kvtransfer.engine import PeerInfo
from kvtransfer.handle import KVHandle
from kvtransfer.leases import Lease, LeaseTable, ReleaseCause
from kvtransfer.settings import TransferSettings
from worker_api.base import WorkerBase
from worker_api.messages import IntegrityReport, LeaseCounters, PrefillResult, ReadyInfo, WorkerReport, WorkItem
from worker_api.protocol import PrefillWorkerAPI, ReadAheadHandle, ReadAheadTarget

log = logging.getLogger("pdserve.prefill")
IDLE_MAINTENANCE_S = 0.5   # idle (no prompt, no lease): notifications are still read this often


class PrefillWorker(WorkerBase):
    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferSettings,
                 torch_threads: int = 1, tp_ranks: Sequence[Any] = ()) -> None:
        super().__init__(worker_id, "prefill", engine_config, transfer, torch_threads, tp_ranks=tp_ranks)
        self.transfer = self._open_transfer()
        # a source that sees its reads refuses those of ended leases; one that does not
        # (one-sided NIXL reads) keeps an expired lease's blocks a transfer timeout longer
        grace = 0.0 if self.transfer.sees_reads else self.settings.timeout
        self.leases = LeaseTable(time.monotonic, self._on_lease_end, expiry_grace=grace)
        self.transfer.set_read_guard(self.leases)
        self._ranks = self.rank_sources(self.transfer)      # every rank's pool and heads (tensor parallel), for handles
        self._maintenance: asyncio.Task | None = None
        self._pending: dict[str, asyncio.Queue] = {}   # request id -> queue, while prefilling
        # request id -> prompt tokens, sent to the engine thread and not yet added (it adds
        # between steps): the engine's stats do not count them yet, the report does
        self._adding: dict[str, int] = {}
        self._fired: set[asyncio.Task] = set()   # read_ahead messages sent in this process
        self._busy = asyncio.Event()   # set when a prefill starts: wakes the idle maintenance

    # ------------------------------------------------------------- control
    async def _start(self) -> None:
        await super()._start()
        if self._maintenance is None:
            self._maintenance = asyncio.get_running_loop().create_task(self._maintain())

    def _ready_info(self) -> ReadyInfo:
        return replace(super()._ready_info(), backend=self.transfer.backend_name,
                       kv_port=self.transfer.peer_info().port)

    def peer_info(self) -> PeerInfo:
        return self.transfer.peer_info()

    async def prefill(self, *, item: WorkItem,
                      read_ahead: ReadAheadTarget | ReadAheadHandle | None = None) -> PrefillResult:
        """Compute the prompt's KV and its first token; pin the blocks for a reader.
        `read_ahead`: a decode worker (a Ray actor handle, or the object itself) whose
        `read_ahead(request_id=, peer=, first_index=, block_ids=, preemptions=, layers=)` is
        told of the prompt blocks completed since it was last told, after every chunk's step
        (all of them again after a preemption), and, while the last chunk computes (the
        engine's `prompt_layer_groups`), of each layer group of the blocks not yet told
        (`layers`). Best effort: a message lost or late only means those blocks are read
        after the first token."""
        await self._start()
        t0 = time.monotonic()
        if self._draining:
            return PrefillResult(first=None, moved=True)
        if self.tp_actors:   # read-ahead reads whole blocks of rank 0 only: readers wait for the handle
            read_ahead = None
        rid = item.request_id
        queue = self.aengine.subscribe(rid)
        self._pending[rid] = queue
        self._reads_expected()
        try:
            self._adding[rid] = len(item.prompt_token_ids)    # reported as queued until the engine has it
            try:
                await self.aengine.call(lambda e: e.add_request(rid, item.prompt_token_ids, item.sampling,
                                                                item.cache_salt, prefill_only=True))
            except QueueFull:
                return PrefillResult(first=None, moved=True, busy=True)
            finally:
                self._adding.pop(rid, None)
            told: list[Awaitable[Any]] = []
            first = await self._first_token(rid, queue, read_ahead, told)
            await _delivered(told)
        except BaseException:
            await self.aengine.call(lambda e: e.abort_request(rid))
            raise
        finally:
            self.aengine.unsubscribe(rid)
            self._pending.pop(rid, None)
        if first is None:   # drain() took it back before it started (or release() ended it)
            return PrefillResult(first=None, moved=True)
        t1 = time.monotonic()
        # the blocks come with the token (StepDelta.held_block_ids): asking the engine thread
        # would wait for the step it is running, adding a whole prefill step to the TTFT
        block_ids = list(first.held_block_ids)
        handle = None
        if first.finish_reason:       # the first token ended it: nobody will read the KV
            self.aengine.post(lambda e: e.release_held(rid))    # not on the TTFT path
        else:
            self.leases.pin(rid, block_ids, self.settings.lease_ttl)
            handle = KVHandle(request_id=rid, peer=self.transfer.peer_info(), block_ids=tuple(block_ids),
                              num_tokens=len(item.prompt_token_ids), lease_ttl_s=self.settings.lease_ttl,
                              preemptions=first.preemptions, ranks=self._ranks)
        # the engine reports the queue time with a sequence's first token
        return PrefillResult(first=first, handle=handle, queue_seconds=first.queue_seconds,
                             prefill_seconds=t1 - t0)

    async def _first_token(self, request_id: str, queue: asyncio.Queue,
                           read_ahead: ReadAheadTarget | ReadAheadHandle | None,
                           told_calls: list[Awaitable[Any]]) -> StepDelta | None:
        """Wait for the request's first token (None: ended before it started), telling
        `read_ahead` of the prompt blocks each chunk completed on the way (the calls go
        into `told_calls`)."""
        told, epoch, layers = 0, 0, 0   # whole blocks and last-chunk layers told, at the preemption count `epoch`
        while True:
            delta: StepDelta | None = await queue.get()
            if delta is None or delta.new_token_ids:
                return delta
            if read_ahead is None:   # a chunk's progress: only a pipelined hand-off wants it
                continue
            if delta.preemptions != epoch:
                told, epoch, layers = 0, delta.preemptions, 0
            blocks, done = delta.computed_block_ids, delta.computed_layers
            if len(blocks) <= told:
                continue
            tell = dict(request_id=request_id, peer=self.transfer.peer_info(), first_index=told,
                        block_ids=blocks[told:], preemptions=epoch)
            if done:   # the last chunk's forward ran layers [0, done): the blocks not told whole, those layers
                first_layer = layers if layers < done else 0
                layers = done
                tell["layers"] = (first_layer, done)
            else:
                told, layers = len(blocks), 0
            with contextlib.suppress(Exception):   # the reader is gone: its submit says so
                told_calls.append(self._fire(read_ahead, **tell))

    async def release(self, *, request_id: str) -> bool:
        """The decode side will not read (cancelled, or it recomputed): free now."""
        if self.leases.release(request_id, ReleaseCause.RELEASED):
            return True
        pending = self._pending.get(request_id)
        if pending is not None:      # still prefilling: end the waiting prefill() call too
            pending.put_nowait(None)
        return await self.aengine.call(lambda e: e.abort_request(request_id))

    async def abort(self, *, request_id: str) -> bool:
        return await self.release(request_id=request_id)

    def renew(self, *, request_id: str, ttl: float | None = None) -> bool:
        """The reader still waits (queued for KV room): keep the blocks pinned
        `ttl` (default lease_ttl) seconds from now. False if the lease is gone."""
        return self.leases.renew(request_id, ttl or self.settings.lease_ttl)

    async def drain(self) -> list[str]:
        """Scale-down: accept no new prefills and hand back the queued, unstarted
        ones (their prefill() returns `moved`). Running prefills finish."""
        moved = await self._stop_taking_work()
        for rid in moved:
            q = self._pending.get(rid)
            if q is not None:
                q.put_nowait(None)
        return moved

    # ----------------------------------------------------------- reporting
    async def report(self) -> WorkerReport:
        report = await super().report()
        if self._adding:
            report = replace(report, stats=replace(report.stats, waiting_tokens=report.stats.waiting_tokens
                                                   + sum(self._adding.values())))
        return replace(report, leases_active=len(self.leases),
                       lease_expiries=self.leases.releases[ReleaseCause.EXPIRED])

    def lease_counters(self) -> LeaseCounters:
        r = self.leases.releases
        return LeaseCounters(active=len(self.leases), expired=r[ReleaseCause.EXPIRED],
                             notified=r[ReleaseCause.NOTIFIED], released=r[ReleaseCause.RELEASED],
                             pinned=self.leases.pins, renewed=self.leases.renewals)

    async def check_integrity(self) -> IntegrityReport:
        """Raise if the engine's pools are inconsistent; return block usage and leases."""
        return replace(await super().check_integrity(), leases=len(self.leases))

    # ------------------------------------------------------------- internal
    def _fire(self, target: ReadAheadTarget | ReadAheadHandle, **kwargs: Any) -> Awaitable[Any]:
        """Call `target.read_ahead` without waiting: a Ray actor method's `.remote`, or
        (one process) a coroutine method scheduled on this loop. Returns what to await
        for its delivery (the reader only starts its reads: delivery is quick)."""
        method = target.read_ahead
        if hasattr(method, "remote"):
            return method.remote(**kwargs)
        call: Callable[..., Coroutine[Any, Any, None]] = method
        task = asyncio.get_running_loop().create_task(call(**kwargs))
        self._fired.add(task)
        task.add_done_callback(self._fired.discard)
        return task

    def _on_lease_end(self, lease: Lease, cause: ReleaseCause) -> None:
        # may run on any thread: hand the free to the engine thread
        self.aengine.post(lambda e: e.release_held(lease.request_id))
        if cause is ReleaseCause.EXPIRED:
            log.warning("lease of %s expired unread: %d blocks freed", lease.request_id, len(lease.block_ids))

    def _reads_expected(self) -> None:
        """A prompt is in prefill: its blocks may be read (ahead, then under its lease) soon."""
        self.transfer.expect_reads(True)
        self._busy.set()

    def _idle(self) -> bool:
        """No prompt in prefill, no lease, no ended lease's blocks left to free: nothing to read."""
        return not self._pending and not len(self.leases) and not self.leases.unfreed

    async def _maintain(self) -> None:
        """Read notifications (this also progresses a passive transfer side) and expire leases,
        every millisecond while there is something to read; idle, wait for a prefill (or
        IDLE_MAINTENANCE_S, for a stray notification) and let the transfer engine poll slowly."""
        while True:
            try:
                for note in self.transfer.get_notifications():
                    self.leases.release_by_notification(note.message)
                self.leases.expire_due()
            except Exception:  # keep the worker alive; the lease expiry is the backstop
                log.exception("prefill maintenance")
            if not self._idle():
                await asyncio.sleep(0.001)
                continue
            self._busy.clear()
            self.transfer.expect_reads(False)
            try:
                await asyncio.wait_for(self._busy.wait(), IDLE_MAINTENANCE_S)
            except asyncio.TimeoutError:
                pass


def _implements_api(worker: PrefillWorker) -> PrefillWorkerAPI:
    return worker   # mypy checks here that PrefillWorker implements the protocol


READ_AHEAD_DELIVERY_S = 0.25   # at most this long for the reader to take the last messages


async def _delivered(calls: list[Awaitable[Any]]) -> None:
    """Before the first token goes back, let the reader take the read-ahead messages sent
    for it (bounded): a submit that follows the token then finds every earlier chunk's
    reads started, rather than racing them (the messages and the submit travel by
    different paths). A reader that fails or is slow only loses the head start."""
    if not calls:
        return
    futures = [asyncio.ensure_future(c) for c in calls]
    for f in futures:   # a lost message is not an error: retrieve it whenever it ends
        f.add_done_callback(lambda f: f.cancelled() or f.exception())
    await asyncio.wait(futures, timeout=READ_AHEAD_DELIVERY_S)

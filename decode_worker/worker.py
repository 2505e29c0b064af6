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
source changed since (a preemption there recomputed it); kv_pull.py moves those
bytes (reads ahead, what is missing, the read that ends the lease), this class
keeps the reservations, the wait for KV room and the engine's side.
A failed or timed-out pull is recomputed here (`PullFailure.RECOMPUTE`) or
handed back to the frontend to prefill elsewhere (`PullFailure.REPORT`). `drain()`
(scale-down) hands back queued, unstarted requests; submits arriving or still
waiting for KV room while draining come back `moved` (nothing joined here).
A plain class; the launcher wraps it with `ray.remote(...)`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, AsyncIterator

from decode_worker.early_notices import EarlyNotices, Notice
from decode_worker.kv_pull import KVPull
from decode_worker.read_ahead import LayerRange
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, QueueFull
from engine.outputs import StepDelta
from engine.sampling_params import SamplingParams
from engine.scheduler import RemoteAllocation
from kvtransfer.engine import PeerInfo, TransferEngine, TransferStatus
from kvtransfer.handle import KVHandle
from kvtransfer.settings import TransferSettings
from worker_api.base import WorkerBase
from worker_api.messages import GiveBack, PullFailure, ReadyInfo, SubmitResult, WorkerReport, WorkItem
from worker_api.protocol import DecodeWorkerAPI

log = logging.getLogger("pdserve.decode")
RESERVATION_TTL_FACTOR = 6   # an unclaimed reservation lives this many transfer timeouts

class DecodeWorker(WorkerBase):
    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferSettings,
                 torch_threads: int = 1, pool: str = "decode", tp_ranks: Sequence[Any] = ()) -> None:
        super().__init__(worker_id, pool, engine_config, transfer, torch_threads, batch_stream=True,
                         tp_ranks=tp_ranks)
        self.transfer: TransferEngine | None = None if pool == "colocated" else self._open_transfer()
        if self.transfer is not None:   # a reader only: nobody reads this pool, no passive side to progress
            self.transfer.expect_reads(False)
        self.kv = KVPull(self.transfer, self.kv_heads, self.tp_actors, self.settings.timeout)   # the pulls
        self._waiting_ids: set[str] = set()   # handed-off requests waiting here for KV room
        self._give_back: set[str] = set()   # of those, to hand back: another worker has room (give_back)
        self._cancelled: set[str] = set()   # aborted while their submit() was still in progress
        self._submitting: set[str] = set()
        self._pulling: set[str] = set()     # blocks allocated and being written by a transfer
        self._reserved: dict[str, RemoteAllocation] = {}   # blocks reserved ahead of a submit
        self._reservation_expiries = 0      # reservations freed unclaimed (reported, cumulative)
        self._expiring: dict[str, asyncio.Event] = {}   # expiries still freeing their blocks
        self._early = EarlyNotices(self.settings.timeout)   # read-ahead notices ahead of their reservation

    @property
    def _awaiting_room(self) -> int:
        """Handed-off requests waiting here for KV room."""
        return len(self._waiting_ids)

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
        self._early.drop(rid)
        await self.kv.settle(rid)

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
        await self._expired(request_id)   # a retry reserving the id again while its old reservation expires
        if self._draining or self.transfer is None or request_id in self._reserved:
            self._early.drop(request_id)
            return False
        self._submitting.add(request_id)
        reserved = False
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
            for n in self._early.take(request_id):   # blocks completed while this call was on its way
                self.kv.read_ahead(request_id, alloc, n.peer, n.first_index, n.block_ids, n.preemptions, n.layers)
            reserved = True
            return True
        finally:
            if not reserved:
                self._early.drop(request_id)
            self._submitting.discard(request_id)
            self._cancelled.discard(request_id)

    async def read_ahead(self, *, request_id: str, peer: PeerInfo, first_index: int,
                         block_ids: tuple[int, ...], preemptions: int, layers: LayerRange | None = None) -> None:
        """The prefill node completed prompt blocks `first_index`.. (its `block_ids`), or
        only their `layers` [l0, l1) (the last chunk, while it computes): read them now into
        the reservation. Without one yet (its reserve call still on its way) the notice is
        kept a while and read once it is made (early_notices.py); ignored for layers this
        transfer backend cannot read apart: the submit then reads them."""
        alloc = self._reserved.get(request_id)
        if alloc is not None:
            self.kv.read_ahead(request_id, alloc, peer, first_index, block_ids, preemptions, layers)
        elif self.transfer is not None and not self._draining:
            self._early.keep(request_id, Notice(peer, first_index, tuple(block_ids), preemptions, layers))

    async def _expire(self, request_id: str, alloc: RemoteAllocation) -> None:
        if self._reserved.get(request_id) is alloc:   # never claimed: its frontend is gone (or slow)
            del self._reserved[request_id]
            self._reservation_expiries += 1
            log.warning("reservation of %s was not claimed in time: freeing its blocks", request_id)
            done = self._expiring[request_id] = asyncio.Event()
            try:
                await self.kv.settle(request_id)
                await self.aengine.call(lambda e: e.abort_request(request_id))
            finally:
                if self._expiring.get(request_id) is done:
                    del self._expiring[request_id]
                done.set()

    async def _expired(self, request_id: str) -> None:
        """Wait until an expiry freeing `request_id`'s earlier reservation is done: the engine
        holds the request id until then and would refuse a new one (a late submit, or a retry
        that reserves the same id again)."""
        while (expiring := self._expiring.get(request_id)) is not None:
            await expiring.wait()

    async def drain(self) -> list[str]:
        """Scale-down: take no new requests; free reservations; abort and return the
        queued, unstarted requests."""
        self._draining = True
        reserved = list(self._reserved)
        self._reserved.clear()
        for rid in reserved:
            await self.kv.settle(rid)
        # the reserved ones' submits come back `moved` and are routed elsewhere
        return await self._stop_taking_work(abort_first=reserved)

    async def give_back(self, *, request_ids: Sequence[str]) -> GiveBack:
        """Hand back those of ``request_ids`` that have not started here, for a decode worker
        with free slots (cluster/orchestration/rebalance.py): hand-offs still waiting for room
        (nothing of them is in this engine: their submits return ``moved`` + ``given_back``,
        the lease still good) and requests queued in the engine with nothing computed (a
        hand-off that waited past ``timeout`` and was queued to recompute here), aborted."""
        if self._draining:
            return GiveBack()
        waiting = tuple(rid for rid in request_ids if rid in self._waiting_ids and rid not in self._cancelled)
        self._give_back.update(waiting)
        rest = [rid for rid in request_ids if rid not in self._waiting_ids]
        queued = tuple(await self.aengine.call(lambda e: e.give_back(rest))) if rest else ()
        return GiveBack(waiting_for_room=waiting, queued=queued)

    async def _pull(self, item: WorkItem, handle: KVHandle, first_token: int,
                    on_pull_failure: PullFailure) -> SubmitResult:
        request_id, prompt_token_ids, params, cache_salt = (item.request_id, item.prompt_token_ids,
                                                            item.sampling, item.cache_salt)
        t_arrived = deadline = time.monotonic()
        deadline += self.settings.timeout
        first = True
        await self._expired(request_id)   # a late submit: its expired reservation may still be freeing
        alloc = self._reserved.pop(request_id, None)
        self._early.drop(request_id)   # no reservation reads them now (the claim reads the rest)
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
                if request_id in self._give_back:   # likewise: another decode worker has room now
                    return SubmitResult(local_prefill=False, joined=False, moved=True, given_back=True,
                                        error="given back: another decode worker has room")
                try:
                    alloc = await self.aengine.call(add)
                except QueueFull as e:   # nothing joined, the lease is still good
                    return SubmitResult(local_prefill=False, joined=False, moved=True, busy=True, error=str(e))
                if alloc is not None:
                    break
                if first:
                    first = False
                    self._waiting_ids.add(request_id)
                if time.monotonic() > deadline:   # no room: queue as a local recompute instead
                    await self.aengine.call(lambda e: _add_with_first_token(
                        e, request_id, prompt_token_ids, params, cache_salt, first_token))
                    return SubmitResult(local_prefill=True, recomputed=True, error="no free KV blocks in time")
                await asyncio.sleep(0.005)
        finally:
            if not first:
                self._waiting_ids.discard(request_id)
                self._give_back.discard(request_id)
        t0 = time.monotonic()
        room_wait = t0 - t_arrived
        status, nbytes, ndesc, err = TransferStatus.DONE, 0, 0, ""
        self._pulling.add(request_id)   # from here only this call frees the blocks (see abort)
        try:
            claim = await self.kv.claim(request_id, handle, alloc)
            if request_id in self._cancelled:   # aborted while its blocks were being allocated
                await self.aengine.call(lambda e: e.abort_request(request_id))
                return SubmitResult(local_prefill=False, error="aborted before its KV arrived", joined=False)
            plan = claim.plan
            status, nbytes, ndesc, err = await self.kv.read_rest(handle, alloc, plan, request_id.encode())
        finally:
            self._pulling.discard(request_id)
        seconds = time.monotonic() - t0
        nbytes += claim.ahead_bytes   # what the reads ahead moved
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

    async def abort(self, *, request_id: str) -> bool:
        if request_id in self._submitting:
            self._cancelled.add(request_id)
        if request_id in self._pulling:   # a transfer still writes into its blocks: _pull frees them after
            return True
        self._reserved.pop(request_id, None)
        self._early.drop(request_id)
        await self.kv.settle(request_id)   # reads ahead into its blocks end first
        return await self.aengine.call(lambda e: e.abort_request(request_id))

    async def report(self) -> WorkerReport:
        """The engine's report; `stats.waiting` also counts hand-offs still waiting
        here for KV room: they are queued on this node (and count against its
        queue bound), so the router and the waiting-requests gauge see them."""
        report = replace(await super().report(), reservation_expiries=self._reservation_expiries)
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

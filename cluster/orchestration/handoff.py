"""One request's way through the cluster, as an explicit state machine.

    ROUTED -> PREFILLING -> HANDED_OFF -> DECODING -> FINISHED
       |          |                          |
       +----------+--> DECODING              +--> MIGRATING -> PREFILLING | HANDED_OFF | DECODING
       (the decode node prefills: routed so, or no prefill node left)

`Handoff.run()` reads top to bottom: route, prefill on a prefill node (first
token + KV handle), submit to the decode node (it pulls the blocks it lacks
while the first token streams; with `first_token_release: decode` the token is
held until the decode node reports the request admitted to its batch:
first_token_hold.py), then stream the decode node's deltas. When
something fails on the way:

- prefill node lost: `prefill_failure_policy` decides. `recompute` (default):
  the decode node prefills the prompt itself. `reprefill`: another prefill node
  prefills prompt + streamed tokens (locally when no other one is live);
- a pull fails or times out: the decode node recomputes it (`recompute`) or
  hands it back to be prefilled again (`reprefill`);
- decode node lost: the request continues on another decode node from prompt
  + streamed tokens (MIGRATING), up to `max_migrations` times;
- a draining worker gives it back unstarted: it is routed again.

While the decode node has not joined, this frontend renews the prefill node's
lease (the one party that knows both nodes); one that vanishes stops renewing
and the lease frees the blocks. Every path that ends the request releases what
it holds: `finish()`. The router counts a routed prompt's prefix as in flight
on its node until this side reports the prefill's end (`_prefill_ended`:
computed there, or failed, given back, aborted, or run elsewhere).
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable

from cluster.config import ServeConfig
from cluster.observability.metrics import Metrics
from cluster.orchestration.backend import BackendError, GenerateJob
from cluster.orchestration.first_token_hold import FirstTokenHold
from cluster.orchestration.handoff_timing import HandoffClock, observe_handoff, observe_transfer
from cluster.orchestration.journal import Journal, Recovery, attempt_id, describe_decision, describe_submit
from cluster.orchestration.messages import Counted, Moved, Tokens, WorkerLost
from cluster.orchestration.pool import WorkerPool
from cluster.orchestration.reservation import Reservation
from cluster.orchestration.work_items import work_item
from cluster.router.policy import DecisionKind, RoutingDecision
from cluster.router.reserve import reserve_at_routing
from engine.block_hash import block_hashes
from engine.outputs import StepDelta
from worker_api.messages import PullFailure

log = logging.getLogger("pdserve.cluster")


class Stage(enum.Enum):
    ROUTED = "routed"
    PREFILLING = "prefilling"
    HANDED_OFF = "handed_off"     # the decode node is joining: pulling the KV, or waiting for room
    DECODING = "decoding"
    MIGRATING = "migrating"       # moving on from prompt + streamed tokens
    FINISHED = "finished"


NEXT_STAGES: dict[Stage, frozenset[Stage]] = {
    Stage.ROUTED: frozenset({Stage.PREFILLING, Stage.DECODING, Stage.FINISHED}),
    Stage.PREFILLING: frozenset({Stage.PREFILLING, Stage.HANDED_OFF, Stage.DECODING, Stage.FINISHED}),
    Stage.HANDED_OFF: frozenset({Stage.DECODING, Stage.MIGRATING, Stage.FINISHED}),
    Stage.DECODING: frozenset({Stage.MIGRATING, Stage.FINISHED}),
    Stage.MIGRATING: frozenset({Stage.MIGRATING, Stage.PREFILLING, Stage.HANDED_OFF, Stage.DECODING,
                                Stage.FINISHED}),
    Stage.FINISHED: frozenset(),
}


class ContinueMode(enum.Enum):
    ROUTE = "route"             # the router decides (a lost or draining decode node)
    REPREFILL = "reprefill"     # another prefill node, else the decode node (a failed pull)


@dataclass
class Hooks:
    """Test-only fault injection points (None in production). after_prefill(job,
    prefill_ref, result): after a prefill returned its KV handle, before the decode node
    is asked to pull it."""
    after_prefill: Callable[[GenerateJob, Any, Any], Awaitable[None]] | None = None


@dataclass
class Shared:
    """What every hand-off of one frontend uses."""
    config: ServeConfig
    pool: WorkerPool
    journal: Journal
    metrics: Metrics
    hooks: Hooks
    by_wid: dict[str, Handoff]    # the worker-side id of each request's current attempt


class _CallFailed(Exception):
    """The submit call itself failed (the worker died, or failed)."""

    def __init__(self, error: BackendError) -> None:
        super().__init__(error.message)
        self.error = error


class Handoff:
    def __init__(self, shared: Shared, job: GenerateJob) -> None:
        self.s = shared
        self.config = shared.config     # as at the request's start (tests switch policies between requests)
        self.job = job                  # as the client sent it: every continuation starts from it
        self.stage = Stage.ROUTED
        self.queue: asyncio.Queue = asyncio.Queue()
        self.wid = job.request_id       # the id workers know this attempt by (journal.attempt_id)
        self.attempts = 0
        self.decode_id: str | None = None
        self.prefill_id: str | None = None    # set while the prefill node holds blocks for this request
        self.emitted: list[int] = []          # tokens streamed so far (n == 1)
        self.migrations = 0
        self.continued = False                # moved on from prompt + emitted at least once
        self.clock: HandoffClock | None = None        # while the first decode token after a hand-off is awaited
        self.reservation: Reservation | None = None
        self.hold: FirstTokenHold | None = None       # while the first token waits for the decode node's admission
        self.sent: tuple[str, str] | None = None      # (id, node) of the routed prefill not ended yet
        self.rebalance_to: str | None = None          # where to submit if the decode node gives it back
        shared.by_wid[self.wid] = self

    def _to(self, stage: Stage) -> None:
        assert stage in NEXT_STAGES[self.stage], f"{self.job.request_id}: {self.stage} -> {stage}"
        self.stage = stage

    # ------------------------------------------------------------- the path
    async def run(self) -> AsyncIterator[StepDelta]:
        """Stream the request's deltas; closing the iterator early aborts it everywhere."""
        job, done, joining = self.job, False, None
        remaining = job.sampling.n
        try:
            decision = await self._route_on_arrival(job)
            self.s.journal.trace(job.request_id, describe_decision(decision))
            self.s.metrics.routing.labels(kind=decision.kind.value).inc()
            result = None
            if decision.kind is DecisionKind.REMOTE_PREFILL and job.sampling.n == 1:
                self._reserve(decision)
                result = await self._prefill(job, decision.prefill_worker_id)
            if result is None:   # the decode node prefills (policy, or no prefill node left)
                await self._submit(job, decision.decode_worker_id, None)
            else:
                remaining -= bool(result.first.finish_reason)
                self.emitted.extend(result.first.new_token_ids)
                if remaining:   # the decode node joins while the first token streams to the client (or waits)
                    self.clock = HandoffClock(time.monotonic())
                    if self.config.first_token_release == "decode":
                        self.hold = FirstTokenHold()
                    joining = asyncio.ensure_future(self._submit(job, decision.decode_worker_id, result.handle,
                                                                 first_token=result.first_token))
                    if self.hold is not None:
                        await self.hold.wait(joining)
                done = not remaining
                self._release_first()
                yield result.first
                if done:
                    return
                await joining
            while remaining:
                delta = await self._next_delta()
                remaining -= bool(delta.finish_reason)
                done = not remaining
                yield delta
        finally:
            await self.finish(done, joining)

    async def _next_delta(self) -> StepDelta:
        """The next delta to stream, after whatever recovery the queue asks for."""
        while True:
            msg = await self.queue.get()
            match msg:
                case WorkerLost(error=err):
                    await self._migrate_or_raise(err)
                    continue
                case Moved(worker_id=wid, rebalanced=rebalanced):   # given back unstarted
                    if wid == self.decode_id:
                        self._note_move(rebalanced)
                        await self._continue(ContinueMode.ROUTE)
                    continue
                case Counted(delta=delta):   # re-prefilled elsewhere: already in `emitted`
                    pass
                case Tokens(delta=delta):
                    self._prefill_ended(True, self.decode_id)   # a local prefill's first token
                    self.emitted.extend(delta.new_token_ids)
                    self._second_token()
            if self.continued:
                delta = replace(delta, num_prompt_tokens=len(self.job.prompt_token_ids))
            return delta

    def _reserve(self, decision: RoutingDecision) -> None:
        """Reserve the hand-off's decode blocks now if its prefill starts within a step
        (cluster/router/reserve.py); either way counted in pdserve_decode_reservations_total."""
        if not self.config.reserve_decode_blocks:
            return
        count = self.s.metrics.count_decode_reservation
        if not reserve_at_routing(decision, self.config.max_num_batched_tokens):
            count("skipped_backlog")
            return
        self.reservation = Reservation.start(self.s.pool, self.wid, self.job, decision.decode_worker_id, count)

    def _release_first(self) -> None:
        """The prefill node's first token goes to the client now."""
        hold, self.hold = self.hold, None
        held = self.clock.released() if self.clock is not None else None
        if hold is not None or held is not None:
            self.s.journal.trace(self.job.request_id, "first token released" + (
                f" after {held * 1e3:.1f} ms" if held is not None else "") + (f" ({hold.reason})" if hold else ""))

    def _admitted(self, worker_id: str) -> None:
        """The decode node took the request into its running batch: the step now running
        computes the next token."""
        if self.clock is not None:
            self.clock.admitted()
        self.s.journal.trace(self.job.request_id, f"admitted by {worker_id} into its running batch")
        if self.hold is not None:
            self.hold.end("admitted")

    def _second_token(self) -> None:
        if self.clock is not None:
            line = observe_handoff(self.s.metrics, self.clock)
            if line:
                self.s.journal.trace(self.job.request_id, line)
            self.clock = None

    async def _route_on_arrival(self, job: GenerateJob):
        """The first routing: through the prefill gate (held while every prefill node is busy,
        with ``prefill_queue_limit`` set; prefill_gate.py). Continuations route at once."""
        self._prefill_ended(False)
        return self._sent(job, await self.s.pool.route_gated(job.request_id, len(job.prompt_token_ids),
                                                              job.block_hashes))

    def _route(self, job: GenerateJob):
        self._prefill_ended(False)
        return self._sent(job, self.s.pool.route(job.request_id, len(job.prompt_token_ids), job.block_hashes))

    def _sent(self, job: GenerateJob, decision: RoutingDecision) -> RoutingDecision:
        self.sent = (job.request_id, decision.prefill_worker_id or decision.decode_worker_id)
        return decision

    def _prefill_ended(self, computed: bool, on: str | None = None) -> None:
        """The routed prefill is over: computed on node ``on``, or not (failed, given back, or run
        elsewhere); the router's in-flight record of it ends (Router.on_prefill_end)."""
        sent, self.sent = self.sent, None
        if sent is not None:
            self.s.pool.prefill_ended(sent[0], computed and on == sent[1])

    # -------------------------------------------------------------- prefill
    async def _prefill(self, job: GenerateJob, prefill_id: str | None):
        """Prefill on `prefill_id`, applying the failure policy. None: the decode node prefills."""
        tried: list[str] = []
        while prefill_id is not None:
            self._to(Stage.PREFILLING)
            ref = self.s.pool.workers[prefill_id]
            self.prefill_id = prefill_id
            try:
                result = await self.s.pool.call(ref, ref.actor.prefill.remote(
                    item=work_item(job), read_ahead=self._read_ahead_actor()))
            except BackendError as e:
                self.prefill_id = None
                self._prefill_ended(False)
                if e.code != "UNAVAILABLE":
                    raise
                self.s.journal.note(job.request_id, Recovery.PREFILL_LOST)
                tried.append(prefill_id)
                prefill_id = self.s.pool.other_prefill(tried) if self.config.prefill_failure_policy == "reprefill" \
                    else None
                continue
            self._prefill_ended(not result.moved, prefill_id)
            if result.moved:
                self.prefill_id = None
                self.s.journal.note(job.request_id, Recovery.BUSY if result.busy else Recovery.MOVED)
                tried.append(prefill_id)
                prefill_id = self.s.pool.other_prefill(tried)
                continue
            await self._prefilled(job, ref, result)
            return result
        return None

    def _read_ahead_actor(self):
        """The decode worker a pipelined hand-off reads ahead into (the reservation's)."""
        if not self.config.pipelined_handoff or self.reservation is None:
            return None
        ref = self.s.pool.workers.get(self.reservation.worker_id)
        return ref.actor if ref is not None else None

    async def _prefilled(self, job: GenerateJob, ref, result) -> None:
        h = result.handle
        self.s.journal.trace(job.request_id, f"prefilled on {ref.worker_id}: first token "
                             f"{result.first.new_token_ids}"
                             + (f", hands off {h.num_tokens} tokens in blocks {list(h.block_ids)}" if h else ""))
        if h is None:
            self.prefill_id = None
        elif self.s.hooks.after_prefill is not None:
            await self.s.hooks.after_prefill(job, ref, result)

    def _release_prefill(self) -> None:
        """Free the prefill node's pins now, without waiting on it (it may be stopped)."""
        ref = self.s.pool.live(self.prefill_id)
        self.prefill_id = None
        if ref is not None:
            self.s.pool.background(ref.actor.release.remote(request_id=self.wid))

    # --------------------------------------------------------------- decode
    async def _submit(self, job: GenerateJob, decode_id: str, handle, first_token: int | None = None) -> None:
        """Join the request to a decode worker (pulling `handle`'s blocks, if any)."""
        await self._settle_reservation(decode_id)
        self._to(Stage.DECODING if handle is None else Stage.HANDED_OFF)
        try:
            sub = await self._submit_somewhere(job, decode_id, handle, first_token)
        except BackendError:   # every decode worker full, or the only one draining
            if handle is not None:
                self._release_prefill()
            raise
        except _CallFailed as e:   # the decode worker died on the way
            if handle is not None:
                self._release_prefill()
            await self._migrate_or_raise(e.error)
            return
        self.s.journal.trace(job.request_id, f"joined {self.decode_id}: {describe_submit(sub)}")
        if handle is not None:
            await self._pulled(sub)

    async def _submit_somewhere(self, job: GenerateJob, decode_id: str, handle, first_token: int | None):
        """Submit to `decode_id`, or to another decode worker when it is full or draining."""
        on_failure = PullFailure.REPORT if self.config.prefill_failure_policy == "reprefill" else PullFailure.RECOMPUTE
        full: list[str] = []              # decode workers that refused it: queue full
        while True:
            decode = self.s.pool.workers[decode_id]
            self.decode_id = decode_id
            try:
                async with self._renewing(handle):
                    sub = await self.s.pool.call(decode, decode.actor.submit.remote(
                        item=work_item(job), handle=handle, first_token=first_token, on_pull_failure=on_failure))
            except BackendError as e:
                raise _CallFailed(e) from e
            if not sub.moved:
                self.rebalance_to = None      # a give-back that came too late: it joined here
                return sub
            if sub.given_back:            # it waited for room there; another worker has some (rebalance.py)
                self._note_move(True)
                decode_id = self._rebalance_target() or decode_id
                continue
            if sub.busy:                  # its queue is full: the least-loaded one not tried yet
                self.s.journal.note(job.request_id, Recovery.BUSY)
                full.append(decode_id)
                decode_id = self._other_decode_or_raise(full)
                continue
            self.s.journal.note(job.request_id, Recovery.MOVED)   # draining: the lease is still good
            moved_from, decode_id = decode_id, self._route(job).decode_worker_id
            self._prefill_ended(False)            # routed for a decode node only: nothing prefills
            if decode_id == moved_from:
                raise BackendError("UNAVAILABLE", f"decode worker {decode_id} is draining and no other "
                                   "one is live; retry the request", retry_after_s=1.0)

    def _note_move(self, rebalanced: bool) -> None:
        self.s.journal.note(self.job.request_id, Recovery.REBALANCED if rebalanced else Recovery.MOVED)
        if rebalanced:
            self.s.metrics.decode_rebalanced.inc()

    def _rebalance_target(self) -> str | None:
        """The live decode worker a rebalance planned for this request, once (else None)."""
        target, self.rebalance_to = self.rebalance_to, None
        return target if self.s.pool.live(target) is not None else None

    def _other_decode_or_raise(self, full: list[str]) -> str:
        decode_id = self.s.pool.other_decode(full)
        if decode_id is None:
            raise BackendError("RESOURCE_EXHAUSTED", "every decode worker's queue is full "
                               "(max_worker_queue); retry later", retry_after_s=1.0)
        return decode_id

    async def _pulled(self, sub) -> None:
        """The decode node's submit of a hand-off returned: account for the pull."""
        if self.clock is not None and sub.transferred_blocks and not sub.error:
            self.clock.joined(sub)
        observe_transfer(self.s.metrics, sub)
        failed_on = self.prefill_id
        if not sub.transferred_blocks:   # nothing read (all cached, or failed): free P now
            self._release_prefill()
        self.prefill_id = None
        if sub.error and sub.local_prefill and sub.recomputed:
            self.s.journal.note(self.wid, Recovery.NO_KV_ROOM)
        if sub.error and not sub.local_prefill:
            self.s.journal.note(self.wid, Recovery.TRANSFER_FAILURE)
            if sub.joined:
                self.s.journal.note(self.wid, Recovery.RECOMPUTED)
        if sub.joined:
            self._to(Stage.DECODING)
            if self.hold is not None and not (sub.recomputed or sub.local_prefill or sub.error):
                self.hold.expect_admission = True
        else:
            await self._continue(ContinueMode.REPREFILL, exclude=[failed_on] if failed_on else [])

    async def _settle_reservation(self, decode_id: str | None) -> None:
        reservation, self.reservation = self.reservation, None
        if reservation is not None:
            await reservation.settle(self.s.pool, self.wid, decode_id)

    @contextlib.asynccontextmanager
    async def _renewing(self, handle):
        """Renew the prefill node's lease every ttl/3 while the decode node has not joined."""
        ref = self.s.pool.workers.get(self.prefill_id or "")
        if handle is None or ref is None:
            yield
            return
        ttl, rid, journal = handle.lease_ttl_s, self.wid, self.s.journal

        async def renew_loop():
            while True:
                await asyncio.sleep(ttl / 3)
                try:
                    if await asyncio.wait_for(ref.actor.renew.remote(request_id=rid, ttl=ttl), ttl / 3):
                        journal.note(rid, Recovery.LEASE_RENEWAL, count_only=True)
                except Exception:   # unreachable: its lease, or its death, frees the blocks
                    pass

        task = asyncio.get_running_loop().create_task(renew_loop())
        try:
            yield
        finally:
            task.cancel()

    # ------------------------------------------------------------- recovery
    async def _migrate_or_raise(self, err: BackendError) -> None:
        """A decode worker died: continue on another one from prompt + streamed tokens."""
        limit = self.config.max_migrations
        if err.code != "UNAVAILABLE" or self.job.sampling.n != 1:
            raise err
        if self.migrations >= limit:
            raise BackendError("UNAVAILABLE", f"{err.message} (after {self.migrations} migrations, the "
                               f"limit set by max_migrations={limit})") from None
        self.migrations += 1
        self.s.metrics.migrations.inc()
        self.s.journal.note(self.job.request_id, Recovery.MIGRATION)
        old = self.s.pool.workers.get(self.decode_id or "")
        if old is not None:   # best effort: it may be unreachable rather than dead
            self.s.pool.background(old.actor.abort.remote(request_id=self.wid))
        log.warning("migrating %s after %d tokens", self.job.request_id, len(self.emitted))
        self.s.journal.trace(self.job.request_id, f"migrating from {self.decode_id} after "
                             f"{len(self.emitted)} tokens")
        await self._continue(ContinueMode.ROUTE)

    async def _continue(self, mode: ContinueMode, exclude: list[str] | None = None) -> None:
        """Continue from prompt + streamed tokens, as a new attempt."""
        self._to(Stage.MIGRATING)
        self.clock = None   # a gap measured across a migration would mix two hand-offs
        if self.hold is not None:   # the token streams now, counted in `emitted` already
            self.hold.end(f"{mode.value} before admission")
        if self._take_queued():
            return
        cont = self._next_attempt()
        decision = self._route(cont)
        self.s.journal.trace(self.job.request_id, f"continues as {self.wid!r} ({mode.value}) after "
                             f"{len(self.emitted)} tokens: {describe_decision(decision)}")
        prefill_id = None
        if mode is ContinueMode.REPREFILL:
            prefill_id = self.s.pool.other_prefill(exclude or [])
            self.s.journal.note(self.job.request_id, Recovery.REPREFILLED if prefill_id else Recovery.RECOMPUTED)
        elif decision.kind is DecisionKind.REMOTE_PREFILL and self.job.sampling.n == 1:
            prefill_id = decision.prefill_worker_id
        handle = None
        result = await self._prefill(cont, prefill_id) if prefill_id else None
        if result is not None:
            self.emitted.extend(result.first.new_token_ids)
            self.queue.put_nowait(Counted(result.first))
            if result.first.finish_reason:
                return
            handle = result.handle
        await self._submit(cont, self._rebalance_target() or decision.decode_worker_id, handle,
                           first_token=result.first_token if result is not None else None)

    def _next_attempt(self) -> GenerateJob:
        """The job of the next attempt: prompt + streamed tokens, under a new worker-side id."""
        job = self.job
        self.s.by_wid.pop(self.wid, None)
        self.attempts += 1
        self.wid = attempt_id(job.request_id, self.attempts)
        self.s.by_wid[self.wid] = self
        prompt = tuple(job.prompt_token_ids) + tuple(self.emitted)
        params = replace(job.sampling, max_tokens=job.sampling.max_tokens - len(self.emitted))
        hashes = tuple(block_hashes(prompt, self.config.block_size, job.cache_salt,
                                    kv_cache_dtype=self.config.kv_cache_dtype))
        self.continued = True
        return replace(job, request_id=self.wid, prompt_token_ids=prompt, sampling=params, block_hashes=hashes)

    def _take_queued(self) -> bool:
        """Before continuing elsewhere: deltas queued for the client count as streamed
        (they will be), messages about the old worker are void, and its late deltas are
        dropped from now on (decode_id no longer names it). True: the end is queued."""
        items = [self.queue.get_nowait() for _ in range(self.queue.qsize())]
        ended = False
        for item in items:
            if isinstance(item, Tokens):
                self.emitted.extend(item.delta.new_token_ids)
                item = Counted(item.delta)
            if isinstance(item, Counted):
                self.queue.put_nowait(item)
                ended = ended or bool(item.delta.finish_reason)
        self.decode_id = None
        return ended

    # --------------------------------------------------------------- events
    def deliver(self, worker_id: str, delta: StepDelta) -> None:
        """A decode worker's delta for this request's current attempt."""
        if worker_id != self.decode_id:   # a migrated-away copy
            return
        if delta.admitted:   # tokenless: nothing for the client
            self._admitted(worker_id)
            return
        self._unhold("a token came first")
        self.queue.put_nowait(Tokens(delta))

    def worker_lost(self, worker_id: str, error: BackendError) -> None:
        if worker_id == self.decode_id:
            self._unhold("decode worker lost")
            self.queue.put_nowait(WorkerLost(error))

    def moved(self, worker_id: str, rebalanced: bool = False) -> None:
        if worker_id == self.decode_id:
            self._unhold("decode worker rebalancing" if rebalanced else "decode worker draining")
            self.queue.put_nowait(Moved(worker_id, rebalanced))

    def _unhold(self, reason: str) -> None:
        if self.hold is not None:
            self.hold.end(reason)

    def may_wait_on(self, worker_id: str) -> bool:
        """It may be waiting on decode worker ``worker_id`` for a slot: joining it (a hand-off
        waiting for room) or joined (perhaps queued, not started); single-sample, no move planned."""
        return self.stage in (Stage.HANDED_OFF, Stage.DECODING) and self.decode_id == worker_id \
            and self.rebalance_to is None and self.job.sampling.n == 1

    def uses(self, worker_id: str) -> bool:
        return worker_id in (self.decode_id, self.prefill_id)

    # ---------------------------------------------------------------- end
    async def finish(self, done: bool, joining: asyncio.Future | None = None) -> None:
        """Release what the request holds: everything, unless it finished."""
        if joining is not None and not joining.done():   # the client left at the first token
            joining.cancel()
            with contextlib.suppress(BaseException):
                await joining
        self.s.by_wid.pop(self.wid, None)
        self.stage = Stage.FINISHED
        self._prefill_ended(False)                   # still open: never computed (aborted, or failed)
        if not done:
            await self.abort()
        else:
            await self._settle_reservation(None)   # finished with the first token: free the reservation

    async def abort(self) -> None:
        """Abort the current attempt wherever it is; idempotent."""
        if self.reservation is not None and self.reservation.worker_id != self.decode_id:
            await self._settle_reservation(None)
        calls = []
        if (ref := self.s.pool.live(self.decode_id)) is not None:
            calls.append(ref.actor.abort.remote(request_id=self.wid))
        if (ref := self.s.pool.live(self.prefill_id)) is not None:
            calls.append(ref.actor.release.remote(request_id=self.wid))
        for c in calls:
            try:   # bounded: a stopped worker must not hold the caller (its lease frees the blocks)
                await asyncio.wait_for(c, self.config.transfer_timeout)
            except Exception:   # a dead worker frees everything anyway
                pass


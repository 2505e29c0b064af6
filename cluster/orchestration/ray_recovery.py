"""How RayClusterBackend keeps a request going when a worker fails or drains.

- Prefill node lost (its `prefill` call fails, or the decode node's pull of
  its KV fails or times out): `prefill_failure_policy` decides. `recompute`
  (default): the decode node prefills the prompt itself. `reprefill`: another
  prefill node prefills prompt + streamed tokens and the decode node pulls
  from it (locally when no other prefill node is live).
- Decode node lost: the request continues on another decode node from prompt
  + streamed tokens, up to `max_migrations` times, then UNAVAILABLE.
- A lease on the prefill node is renewed by the frontend while the decode
  node's `submit` is pending (queued for KV room or pulling): the frontend is
  the one party that knows both nodes, so the decode worker needs no handle
  to the prefill actor. A frontend that vanishes stops renewing and the lease
  expires, which frees the blocks.
- `drain_worker(id)` (scale-down, ray_drain.py): routing stops at once,
  queued (unstarted) requests move to other workers, running ones finish.

A mixin of RayClusterBackend (whose attributes it uses).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable

from cluster.orchestration.backend import BackendError, GenerateJob
from cluster.router.policy import DecisionKind
from engine.block_hash import block_hashes

log = logging.getLogger("pdserve.cluster")
EVENT_LOG_LEN = 100_000
trace_log = logging.getLogger("pdserve.requests")


@dataclass
class RecoveryCounters:
    """Cumulative, per frontend process (tests and the admin API read them)."""
    migrations: int = 0          # decode node died: continued on another one
    moved: int = 0               # a draining worker handed a queued request back
    prefill_lost: int = 0        # a prefill call failed: the node died or is unreachable
    transfer_failures: int = 0   # KV pulls that failed or timed out
    recomputed: int = 0          # ... then recomputed on the decode node
    reprefilled: int = 0         # ... then prefilled again on another prefill node
    no_kv_room: int = 0          # the decode node found no KV room within transfer_timeout:
                                 # recomputed there, nothing pulled
    busy: int = 0                # a worker's queue was full (max_worker_queue): sent to another one
    lease_renewals: int = 0


@dataclass
class RecoveryHooks:
    """Test-only fault injection points (None in production).
    after_prefill(job, prefill_ref, result): runs after a prefill returned its
    KV handle and before the decode node is asked to pull it."""
    after_prefill: Callable[[GenerateJob, Any, Any], Awaitable[None]] | None = None


@dataclass(frozen=True)
class Moved:   # queue marker: the draining worker `worker_id` gave the request back unstarted
    worker_id: str


@dataclass(frozen=True)
class Prefilled:   # queue marker: a delta already counted in `emitted`
    delta: Any


@dataclass
class RecoveryState:
    counters: RecoveryCounters = field(default_factory=RecoveryCounters)
    hooks: RecoveryHooks = field(default_factory=RecoveryHooks)
    draining: set[str] = field(default_factory=set)
    events: deque = field(default_factory=lambda: deque(maxlen=EVENT_LOG_LEN))   # (request id, kind)
    background: set[asyncio.Task] = field(default_factory=set)


def attempt_id(request_id: str, attempt: int) -> str:
    """Workers know each attempt of a request by its own id: a continuation never meets
    what a worker still holds of an earlier attempt (a held prefill, a late read
    notification). The space cannot occur in a client's id (validation)."""
    return f"{client_id(request_id)} ~{attempt}"


def describe_decision(decision) -> str:
    return f"routed {decision.kind.value}, prefill {decision.prefill_worker_id}, decode {decision.decode_worker_id}"


def describe_submit(sub) -> str:
    parts = ["local prefill" if sub.local_prefill else f"{sub.cached_blocks} blocks cached, "
             f"{sub.transferred_blocks} pulled", f"blocks {list(sub.block_ids)}"]
    if sub.recomputed:
        parts.append("recomputed")
    if sub.moved:
        parts.append("moved")
    if sub.error:
        parts.append(f"error {sub.error!r}")
    return ", ".join(parts)


def client_id(request_id: str) -> str:
    return request_id.split(" ", 1)[0]


class RecoveryMixin:
    recovery: RecoveryState

    # ----------------------------------------------------------- bookkeeping
    def _note(self, rid: str, kind: str) -> None:
        c = self.recovery.counters
        setattr(c, kind, getattr(c, kind) + 1)
        self.recovery.events.append((client_id(rid), kind))

    def _trace(self, rid: str, text: str) -> None:
        """What the cluster did with a request (route, hand-off, join), for explaining one
        afterwards: kept with the recovery events and logged on `pdserve.requests` at DEBUG
        (`--log-level INFO,pdserve.requests=DEBUG`)."""
        self.recovery.events.append((client_id(rid), text))
        trace_log.debug("%s: %s", rid, text)

    def request_events(self, request_id: str) -> list[str]:
        """What happened to a request (recent ones): migrations, moves, recomputes..."""
        rid = client_id(request_id)
        return [k for r, k in self.recovery.events if r == rid]

    def _background(self, awaitable, timeout: float) -> None:
        async def run():
            try:
                await asyncio.wait_for(awaitable, timeout)
            except Exception:   # best effort: a dead worker frees everything anyway
                pass
        task = asyncio.get_running_loop().create_task(run())
        self.recovery.background.add(task)
        task.add_done_callback(self.recovery.background.discard)

    def _release_prefill(self, state, rid: str) -> None:
        """Free the prefill node's pins now, without waiting on it (it may be stopped)."""
        ref = self.workers.get(state.prefill_id or "")
        state.prefill_id = None
        if ref is not None and ref.alive:
            self._background(ref.actor.release.remote(rid), self.config.transfer_timeout)

    # --------------------------------------------------------------- prefill
    async def _prefill(self, job: GenerateJob, state, prefill_id: str | None):
        """Prefill on `prefill_id`, applying the failure policy. None: prefill on the decode node."""
        tried: list[str] = []
        while prefill_id is not None:
            ref = self.workers[prefill_id]
            state.prefill_id = prefill_id
            reader = self.workers.get(state.reserved_on or "") if self.config.pipelined_handoff else None
            try:
                result = await self._call(ref, ref.actor.prefill.remote(
                    job.request_id, list(job.prompt_token_ids), job.sampling, job.cache_salt,
                    read_ahead=reader.actor if reader is not None else None), job.deadline)
            except BackendError as e:
                state.prefill_id = None
                if e.code != "UNAVAILABLE":
                    raise
                self._note(job.request_id, "prefill_lost")
                tried.append(prefill_id)
                prefill_id = self._other_prefill(tried) if self.config.prefill_failure_policy == "reprefill" else None
                continue
            if result.moved:
                state.prefill_id = None
                self._note(job.request_id, "busy" if result.busy else "moved")
                tried.append(prefill_id)
                prefill_id = self._other_prefill(tried)
                continue
            h = result.handle
            self._trace(job.request_id, f"prefilled on {prefill_id}: first token {result.first.new_token_ids}"
                        + (f", hands off {h.num_tokens} tokens in blocks {list(h.block_ids)}" if h else ""))
            if result.handle is None:
                state.prefill_id = None
            elif self.recovery.hooks.after_prefill is not None:
                await self.recovery.hooks.after_prefill(job, ref, result)
            return result
        return None

    def _other_prefill(self, exclude: list[str]) -> str | None:
        """The least-loaded live prefill node not in `exclude` (draining ones are not live)."""
        return self._least_loaded(self.router.view.prefill, exclude, lambda load: (load.queued_prefill_tokens,))

    def _other_decode(self, exclude: list[str]) -> str | None:
        """The least-loaded live decode node not in `exclude`."""
        return self._least_loaded(self.router.view.decode, exclude, lambda load: (load.waiting, load.running))

    def _least_loaded(self, views, exclude: list[str], key) -> str | None:
        live = [v for v in views if v.worker_id not in exclude and self.workers[v.worker_id].alive]
        return min(live, key=lambda v: (*key(v.load), v.worker_id)).worker_id if live else None

    # ---------------------------------------------------------------- decode
    def _reserve_ahead(self, job: GenerateJob, state, decode_id: str | None) -> None:
        """While the prompt is prefilled, reserve its KV blocks on the decode worker the
        router chose: the submit after the prefill then pulls at once instead of first
        waiting an engine step for room (`reserve_decode_blocks`)."""
        ref = self.workers.get(decode_id or "")
        if not self.config.reserve_decode_blocks or ref is None or not ref.alive:
            return

        async def reserve() -> bool:
            try:
                return await self._call(ref, ref.actor.reserve.remote(
                    state.wid, list(job.prompt_token_ids), job.sampling, job.cache_salt), job.deadline)
            except BackendError:   # dead or slow: the submit finds out and allocates as before
                return False
        state.reserved_on = decode_id
        state.reservation = asyncio.get_running_loop().create_task(reserve())

    async def _settle_reservation(self, state, decode_id: str | None) -> None:
        """Before a submit to `decode_id` (None: no submit follows): wait for the
        reservation to be made; a reservation on another worker is freed."""
        task, on = state.reservation, state.reserved_on
        state.reservation = state.reserved_on = None
        if task is None:
            return
        free, reserved = on != decode_id, False
        try:
            reserved = await task
        except asyncio.CancelledError:   # no submit follows: free whatever was reserved
            free = reserved = True
            raise
        except Exception:
            pass
        finally:
            ref = self.workers.get(on or "")
            if free and reserved and ref is not None and ref.alive:
                self._background(ref.actor.abort.remote(state.wid), self.config.transfer_timeout)

    async def _submit(self, job: GenerateJob, state, decode_id: str, handle) -> None:
        """Join the request to a decode worker (pulling `handle`'s blocks, if any)."""
        rid = job.request_id
        await self._settle_reservation(state, decode_id)
        on_failure = "report" if self.config.prefill_failure_policy == "reprefill" else "recompute"
        full: list[str] = []              # decode workers that refused it: queue full
        while True:
            decode = self.workers[decode_id]
            state.decode_id = decode_id
            try:
                async with self._renewing(rid, state, handle):
                    sub = await self._call(decode, decode.actor.submit.remote(
                        rid, list(job.prompt_token_ids), job.sampling, job.cache_salt, handle, on_failure),
                        job.deadline)
            except BackendError as e:
                if handle is not None:
                    self._release_prefill(state, rid)
                await self._migrate_or_raise(job, state, e)
                return
            if not sub.moved:
                break
            if sub.busy:                  # its queue is full: the least-loaded one not tried yet
                self._note(rid, "busy")
                full.append(decode_id)
                decode_id = self._other_decode(full)
                if decode_id is None:
                    if handle is not None:
                        self._release_prefill(state, rid)
                    raise BackendError("RESOURCE_EXHAUSTED", "every decode worker's queue is full "
                                       "(max_worker_queue); retry later", retry_after_s=1.0)
                continue
            self._note(rid, "moved")      # the decode node is draining: the lease is still good
            moved_from = decode_id
            decode_id = self._route(job, job.prompt_token_ids, job.block_hashes).decode_worker_id
            if decode_id == moved_from:
                raise BackendError("UNAVAILABLE", f"decode worker {decode_id} is draining and no other "
                                   "one is live; retry the request", retry_after_s=1.0)
        self._trace(rid, f"joined {decode_id}: {describe_submit(sub)}")
        if handle is None:
            return
        clock = state.handoff
        if clock is not None and sub.transferred_blocks and not sub.error:
            clock.joined_at, clock.room_s, clock.pull_s = time.monotonic(), sub.room_wait_seconds, sub.transfer_seconds
            clock.reserved = sub.reserved
        self._observe_transfer(sub)
        failed_on = state.prefill_id
        if not sub.transferred_blocks:   # nothing read (all cached, or failed): free P now
            self._release_prefill(state, rid)
        state.prefill_id = None
        if sub.error and sub.local_prefill and sub.recomputed:
            self._note(rid, "no_kv_room")
        if sub.error and not sub.local_prefill:
            self._note(rid, "transfer_failures")
            if sub.joined:
                self._note(rid, "recomputed")
        if not sub.joined:
            await self._continue(job, state, "reprefill", exclude=[failed_on] if failed_on else [])

    @contextlib.asynccontextmanager
    async def _renewing(self, rid: str, state, handle):
        """Renew the prefill node's lease every ttl/3 while the decode node has not joined."""
        ref = self.workers.get(state.prefill_id or "")
        if handle is None or ref is None:
            yield
            return
        ttl = handle.lease_ttl_s

        async def renew_loop():
            while True:
                await asyncio.sleep(ttl / 3)
                try:
                    if await asyncio.wait_for(ref.actor.renew.remote(rid, ttl), ttl / 3):
                        self.recovery.counters.lease_renewals += 1
                except Exception:   # unreachable: its lease, or its death, frees the blocks
                    pass

        task = asyncio.get_running_loop().create_task(renew_loop())
        try:
            yield
        finally:
            task.cancel()

    async def _migrate_or_raise(self, job: GenerateJob, state, err: BackendError) -> None:
        """A decode worker died: continue on another one from prompt + streamed tokens."""
        limit = self.config.max_migrations
        if err.code != "UNAVAILABLE" or job.sampling.n != 1:
            raise err
        if state.migrations >= limit:
            raise BackendError("UNAVAILABLE", f"{err.message} (after {state.migrations} migrations, the "
                               f"limit set by max_migrations={limit})") from None
        state.migrations += 1
        self.metrics.migrations.inc()
        self._note(job.request_id, "migrations")
        old = self.workers.get(state.decode_id or "")
        if old is not None:   # best effort: it may be unreachable rather than dead
            self._background(old.actor.abort.remote(state.wid), self.config.transfer_timeout)
        log.warning("migrating %s after %d tokens", job.request_id, len(state.emitted))
        self._trace(job.request_id, f"migrating from {state.decode_id} after {len(state.emitted)} tokens")
        await self._continue(job, state, "route")

    async def _continue(self, job: GenerateJob, state, mode: str, exclude: list[str] = ()) -> None:
        """Continue from prompt + streamed tokens. mode: 'route' (the router decides),
        'reprefill' (another prefill node, else the decode node)."""
        state.handoff = None   # a gap measured across a migration would mix two hand-offs
        if self._take_queued(state):
            return
        job = state.job or job   # the client's job: `job` may be an earlier continuation
        self._by_wid.pop(state.wid, None)
        state.attempts += 1
        state.wid = attempt_id(job.request_id, state.attempts)
        self._by_wid[state.wid] = state
        prompt = tuple(job.prompt_token_ids) + tuple(state.emitted)
        params = replace(job.sampling, max_tokens=job.sampling.max_tokens - len(state.emitted))
        hashes = tuple(block_hashes(prompt, self.config.block_size, job.cache_salt,
                                    kv_cache_dtype=self.config.kv_cache_dtype))
        cont = replace(job, request_id=state.wid, prompt_token_ids=prompt, sampling=params, block_hashes=hashes)
        state.continued = True
        decision = self._route(cont, prompt, hashes)
        self._trace(job.request_id, f"continues as {state.wid!r} ({mode}) after {len(state.emitted)} tokens: "
                    f"{describe_decision(decision)}")
        prefill_id = None
        if mode == "reprefill":
            prefill_id = self._other_prefill(list(exclude))
            self._note(job.request_id, "reprefilled" if prefill_id else "recomputed")
        elif decision.kind is DecisionKind.REMOTE_PREFILL and job.sampling.n == 1:
            prefill_id = decision.prefill_worker_id
        handle = None
        result = await self._prefill(cont, state, prefill_id) if prefill_id else None
        if result is not None:
            state.emitted.extend(result.first.new_token_ids)
            state.queue.put_nowait(Prefilled(result.first))
            if result.first.finish_reason:
                return
            handle = result.handle
        await self._submit(cont, state, decision.decode_worker_id, handle)

    @staticmethod
    def _take_queued(state) -> bool:
        """Before continuing elsewhere: deltas queued for the client count as streamed
        (they will be), markers about the old worker are void, and its late deltas are
        dropped from now on (decode_id no longer names it). True: the end is queued."""
        items = [state.queue.get_nowait() for _ in range(state.queue.qsize())]
        for item in items:
            if not isinstance(item, (BackendError, Moved, Prefilled)):
                state.emitted.extend(item.new_token_ids)
                item = Prefilled(item)
            if isinstance(item, Prefilled):
                state.queue.put_nowait(item)
        state.decode_id = None
        return any(isinstance(i, Prefilled) and i.delta.finish_reason for i in items)

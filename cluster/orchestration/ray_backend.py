"""RayClusterBackend: router + prefill / decode actor pools behind the frontend.

Per request: route -> (remote prefill on P: first token + KV handle) ->
submit to D (pull missing blocks, or prefill locally) -> stream D's deltas.
D's outputs arrive on one stream per decode worker (one message per engine
step) and are fanned out here to per-request queues. Worker reports (load +
KV events) are polled every `report_interval` and feed the router index and
the metrics. Failure handling and lease renewal: ray_recovery.py; draining
one worker: ray_drain.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from cluster.orchestration.backend import BackendError, GenerateJob, GenerationBackend, ModelInfoData
from cluster.config import ServeConfig
from cluster.orchestration.launcher import WorkerRef, launch_workers
from cluster.orchestration.local import next_delta
from cluster.observability.metrics import Metrics, TierStats, WorkerStats
from cluster.orchestration.ray_drain import DrainMixin
from cluster.orchestration.ray_recovery import Moved, Prefilled, RecoveryMixin, RecoveryState, describe_decision
from cluster.router.policy import DecisionKind, NoWorkerAvailable, RoutingRequest
from cluster.orchestration.router_config import router_config
from cluster.router.router import Router
from engine.outputs import StepDelta

log = logging.getLogger("pdserve.cluster")


@dataclass
class _Inflight:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    decode_id: str | None = None
    prefill_id: str | None = None
    emitted: list[int] = field(default_factory=list)   # tokens streamed so far (n == 1)
    migrations: int = 0
    continued: bool = False      # moved on from prompt + emitted at least once
    wid: str = ""                # the id workers know this attempt by (see ray_recovery.attempt_id)
    attempts: int = 0
    job: GenerateJob | None = None   # as the client sent it: every continuation starts from it
    handoff: HandoffClock | None = None   # set while the first decode token after a hand-off is awaited
    reservation: asyncio.Task | None = None   # decode blocks being reserved while the prompt is prefilled
    reserved_on: str | None = None   # the decode worker holding them until a submit claims them


@dataclass
class HandoffClock:
    """When a request's first token left the prefill node, when the decode node joined it,
    and what that join cost: the second token then closes the hand-off gap."""
    first_token_at: float
    joined_at: float = 0.0
    room_s: float = 0.0
    pull_s: float = 0.0
    reserved: bool = False   # the decode blocks were reserved during the prefill


class RayClusterBackend(RecoveryMixin, DrainMixin, GenerationBackend):
    def __init__(self, config: ServeConfig, metrics: Metrics, *, report_interval: float = 0.1,
                 tokenizer=None) -> None:
        from engine.loader.load import load_model_config, resolve_model_path
        from engine.tokenizer import Tokenizer

        self.config = config
        self.metrics = metrics
        self.model_path = resolve_model_path(config.model or None)
        self._tokenizer = tokenizer or Tokenizer.load(self.model_path)
        model = load_model_config(self.model_path)
        self._vocab_size = model.vocab_size                 # ids the model accepts (>= the tokenizer's)
        self._max_model_len = config.max_model_len or model.max_position_embeddings   # 0 = the model's
        self.router = Router(router_config(config), rng=random.Random(0), clock=time.monotonic)
        self.workers: dict[str, WorkerRef] = {}
        self._inflight: dict[str, _Inflight] = {}
        self._by_wid: dict[str, _Inflight] = {}     # worker-side id of the current attempt -> state
        self._streaming: set[str] = set()            # decode workers whose output stream is up
        self._tasks: list[asyncio.Task] = []
        self._report_interval = report_interval
        self._stopping = False
        self.recovery = RecoveryState()

    # ---------------------------------------------------------------- life
    async def start(self) -> None:
        refs = await launch_workers(self.config)
        for ref in refs:
            self.workers[ref.worker_id] = ref
            self.router.add_worker(ref.worker_id, ref.pool)
        loop = asyncio.get_running_loop()
        for ref in refs:
            if ref.pool != "prefill":
                self._tasks.append(loop.create_task(self._consume(ref)))
        self._tasks.append(loop.create_task(self._poll_reports()))

    async def stop(self) -> None:
        import ray

        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await self._shutdown_check()
        for ref in self.workers.values():
            try:
                ray.kill(ref.actor)
            except Exception:
                pass

    async def _shutdown_check(self) -> None:
        """Log each live worker's integrity and blocks in use: a leak shows at shutdown."""
        live = [r for r in self.workers.values() if r.alive]
        try:
            states = await asyncio.wait_for(asyncio.gather(
                *[r.actor.check_integrity.remote() for r in live], return_exceptions=True), 10.0)
        except Exception:
            return
        for ref, st in zip(live, states):
            if isinstance(st, Exception):
                log.warning("shutdown check: %s failed: %s", ref.worker_id, st)
            else:
                log.info("shutdown check: %s: integrity ok, %d KV blocks in use", ref.worker_id,
                         st["kv_blocks_used"])

    # ------------------------------------------------------------ requests
    async def generate(self, job: GenerateJob) -> AsyncIterator[StepDelta]:
        rid = job.request_id
        if rid in self._inflight:
            raise BackendError("ALREADY_EXISTS", f"request id {rid!r} is in flight; use a unique id")
        state = self._inflight[rid] = self._by_wid[rid] = _Inflight(wid=rid, job=job)
        done = False
        joining: asyncio.Future | None = None   # the hand-off's submit, started before the first token's yield
        try:
            decision = self._route(job, job.prompt_token_ids, job.block_hashes)
            self._trace(rid, describe_decision(decision))
            self.metrics.routing.labels(kind=decision.kind.value).inc()
            remaining = job.sampling.n
            result = None
            if decision.kind is DecisionKind.REMOTE_PREFILL and job.sampling.n == 1:
                self._reserve_ahead(job, state, decision.decode_worker_id)
                result = await self._prefill(job, state, decision.prefill_worker_id)
            if result is None:   # the decode node prefills (policy, or no prefill node left)
                await self._submit(job, state, decision.decode_worker_id, None)
            else:
                if result.first.finish_reason:
                    remaining -= 1
                done = remaining == 0
                state.emitted.extend(result.first.new_token_ids)
                if not done:   # the decode node joins while the first token streams to the client
                    state.handoff = HandoffClock(time.monotonic())
                    joining = asyncio.ensure_future(self._submit(job, state, decision.decode_worker_id,
                                                                 result.handle))
                yield result.first
                if done:
                    return
                await joining
            while remaining:
                item = await next_delta(state.queue, job.deadline)
                if isinstance(item, BackendError):
                    await self._migrate_or_raise(job, state, item)
                    continue
                if isinstance(item, Moved):   # a draining decode worker gave it back unstarted
                    if item.worker_id == state.decode_id:
                        self._note(rid, "moved")
                        await self._continue(job, state, "route")
                    continue
                if isinstance(item, Prefilled):   # re-prefilled elsewhere: already in `emitted`
                    item = item.delta
                else:
                    state.emitted.extend(item.new_token_ids)
                    if state.handoff is not None:
                        self._observe_handoff(rid, state.handoff)
                        state.handoff = None
                if state.continued:
                    item = replace(item, num_prompt_tokens=len(job.prompt_token_ids))
                if item.finish_reason:
                    remaining -= 1
                done = remaining == 0
                yield item
        finally:
            if joining is not None and not joining.done():   # the client left at the first token
                joining.cancel()
                with contextlib.suppress(BaseException):
                    await joining
            self._inflight.pop(rid, None)
            self._by_wid.pop(state.wid, None)
            if not done:
                await self._abort_state(state.wid, state)
            elif state.reserved_on is not None:   # finished with the first token: free the reservation
                await self._settle_reservation(state, None)

    def _route(self, job: GenerateJob, prompt, hashes):
        try:
            return self.router.route(RoutingRequest(job.request_id, len(prompt), tuple(hashes),
                                                    self.config.block_size))
        except NoWorkerAvailable as e:
            raise BackendError("UNAVAILABLE", f"no worker available: {e}", retry_after_s=1.0) from e

    async def _call(self, ref: WorkerRef, object_ref, deadline: float | None):
        import ray.exceptions as rex

        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return await asyncio.wait_for(object_ref, timeout)
        except asyncio.TimeoutError:
            raise BackendError("DEADLINE_EXCEEDED", "the request's deadline passed before it finished") from None
        except (rex.RayActorError, rex.ActorUnavailableError) as e:
            self._mark_dead(ref)
            raise BackendError("UNAVAILABLE", f"worker {ref.worker_id} died; retry the request") from e
        except rex.RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, ValueError):
                raise BackendError("INVALID_ARGUMENT", str(cause).splitlines()[-1]) from e
            raise BackendError("INTERNAL", f"worker {ref.worker_id} failed: {type(cause).__name__}") from e

    async def abort(self, request_id: str) -> None:
        state = self._inflight.get(request_id)
        if state is not None:
            await self._abort_state(state.wid, state)

    async def _abort_state(self, rid: str, state: _Inflight) -> None:
        if state.reserved_on is not None and state.reserved_on != state.decode_id:
            await self._settle_reservation(state, None)
        calls = []
        if state.decode_id and self.workers[state.decode_id].alive:
            calls.append(self.workers[state.decode_id].actor.abort.remote(rid))
        if state.prefill_id and self.workers[state.prefill_id].alive:
            calls.append(self.workers[state.prefill_id].actor.release.remote(rid))
        for c in calls:
            try:   # bounded: a stopped worker must not hold the caller (its lease frees the blocks)
                await asyncio.wait_for(c, self.config.transfer_timeout)
            except Exception:   # a dead worker frees everything anyway
                pass

    def _observe_handoff(self, rid: str, clock: HandoffClock) -> None:
        """The first decode token after a hand-off arrived: record the gap and its stages."""
        if not clock.joined_at:   # the submit did not pull (recomputed, moved): no clean breakdown
            return
        now = time.monotonic()
        stages = {"join": clock.joined_at - clock.first_token_at, "room": clock.room_s, "pull": clock.pull_s,
                  "first_step": now - clock.joined_at, "total": now - clock.first_token_at}
        for stage, seconds in stages.items():
            self.metrics.handoff.labels(stage=stage).observe(max(0.0, seconds))
        self._trace(rid, "second token " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in stages.items())
                    + (" (blocks reserved ahead)" if clock.reserved else ""))

    def _observe_transfer(self, sub) -> None:
        if sub.error and not sub.local_prefill:   # a failed or timed-out pull (not "no KV room")
            self.metrics.transfer_failures.inc()
        if sub.transferred_blocks:
            self.metrics.transfer_seconds.observe(sub.transfer_seconds)
            self.metrics.transfer_bytes.observe(sub.transferred_bytes)
            self.metrics.transfer_blocks.inc(sub.transferred_blocks)

    # ------------------------------------------------------ worker streams
    async def _consume(self, ref: WorkerRef) -> None:
        """Fan out one decode worker's per-step batches; survive its restarts."""
        while not self._stopping:
            try:
                gen = ref.actor.output_stream.options(num_returns="streaming").remote()
                async for obj in gen:
                    batch = await obj
                    ref.alive = True    # the stream's first (empty) batch says it is back
                    self._streaming.add(ref.worker_id)
                    for d in batch:
                        st = self._by_wid.get(d.request_id)
                        if st is not None and st.decode_id == ref.worker_id:   # not a migrated-away copy
                            st.queue.put_nowait(d)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("output stream of %s broke: %s", ref.worker_id, type(e).__name__)
                self._streaming.discard(ref.worker_id)
                self._mark_dead(ref)
                await asyncio.sleep(0.5)

    def _mark_dead(self, ref: WorkerRef) -> None:
        if not ref.alive:   # already handled: its requests were told once
            return
        log.warning("worker %s is gone; its requests migrate or end with UNAVAILABLE", ref.worker_id)
        ref.alive = False
        self.router.on_worker_dead(ref.worker_id)
        self.metrics.forget_worker(ref.worker_id, ref.pool)
        err = BackendError("UNAVAILABLE", f"worker {ref.worker_id} died mid-request; retry the request")
        for st in self._inflight.values():
            if st.decode_id == ref.worker_id:
                st.queue.put_nowait(err)

    async def _poll_reports(self) -> None:
        while not self._stopping:
            await asyncio.gather(*[self._poll_one(ref) for ref in self.workers.values()])
            await asyncio.sleep(self._report_interval)

    async def _poll_one(self, ref: WorkerRef) -> None:
        try:
            report = await asyncio.wait_for(ref.actor.report.remote(), 5.0)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:   # slow (a loaded host), not dead: only Ray says dead
            log.info("report of %s timed out; keeping it", ref.worker_id)
            return
        except Exception:
            self._mark_dead(ref)
            return
        if ref.worker_id in self.recovery.draining:   # unrouted: its reports must not revive it
            return
        if not ref.alive and ref.pool != "prefill" and ref.worker_id not in self._streaming:
            return   # a decode worker is back only once its output stream is (see _consume); a late
            # failure of a call to its previous incarnation must not keep a live one unrouted
        revived = not ref.alive or ref.worker_id not in self.router.index.worker_ids
        ref.alive = True
        result = self.router.on_events(ref.worker_id, report.events)
        if revived or result.needs_resync:
            try:
                self.router.on_snapshot(ref.worker_id, await ref.actor.kv_snapshot.remote())
            except Exception:
                return
        s = report.stats
        stats = WorkerStats(ref.worker_id, ref.pool, s.running, s.waiting, s.kv_blocks_used, s.kv_blocks_total,
                            s.prefix_queried_tokens, s.prefix_hit_tokens, report.lease_expiries,
                            report.leases_active, s.preemptions, TierStats.from_engine(s))
        self.router.observe_stats(stats, queued_prefill_tokens=s.waiting_tokens)
        self.metrics.observe_worker(stats)

    # ---------------------------------------------------------------- info
    def model_info(self) -> ModelInfoData:
        pools: dict[str, int] = {}
        for ref in self.workers.values():
            pools[ref.pool] = pools.get(ref.pool, 0) + 1
        name = self.config.served_model_name[0] if self.config.served_model_name else self.model_path.name
        return ModelInfoData(name, self._max_model_len, self.config.block_size,
                             self._vocab_size, pools, tokenizer_vocab_size=self._tokenizer.vocab_size,
                             kv_cache_dtype=self.config.kv_cache_dtype)

    def tokenizer(self):
        return self._tokenizer

    async def call_worker(self, worker_id: str, method: str, *args):
        """Call a worker method by name (tests and admin tools)."""
        return await getattr(self.workers[worker_id].actor, method).remote(*args)

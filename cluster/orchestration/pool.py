"""WorkerPool: the prefill and decode worker actors one frontend serves with.

It owns the worker handles, their health (alive, dead, draining) and their
membership in the router: a worker is routed to while it is alive and not
draining. A pool grows by one worker (`grow`: routed once it is ready and its
first report and KV snapshot reached the router) and loses one for good
(`remove`, after drain.retire_worker emptied it). It polls every worker's report (load and KV events -> router index
and metrics), consumes each decode worker's output stream (one message per
engine step) and hands each delta to `deliver`, and turns a failed call into
the `BackendError` a frontend understands, marking a worker that died so its
requests hear of it (`on_lost`).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, Awaitable, Callable, Iterable

from cluster.config import ServeConfig
from cluster.observability.metrics import Metrics, TierStats, WorkerStats
from cluster.orchestration.backend import BackendError
from cluster.orchestration.launcher import WorkerLauncher, WorkerRef, launch_workers
from cluster.orchestration.prefill_gate import PrefillGate
from cluster.orchestration.router_config import router_config
from cluster.router.policy import NoWorkerAvailable, RoutingDecision, RoutingRequest
from cluster.router.router import Router
from engine.outputs import StepDelta

log = logging.getLogger("pdserve.cluster")
REPORT_TIMEOUT_S = 5.0
# A KV snapshot is the whole prefix index of a worker (larger than a report). Bounded like a
# report: one call left hanging (a link back from a partition with the reply lost) would
# otherwise stop every worker's reports, since one poll awaits them all.
SNAPSHOT_TIMEOUT_S = 15.0
# While every worker reports itself idle (nothing running or queued, no KV events, no leases) the
# poll backs off, doubling up to this; a routed request (route()) or a busy report brings it back.
IDLE_REPORT_INTERVAL_S = 1.0


def next_report_interval(current: float, quiet: bool, base: float, idle_cap: float) -> float:
    """The wait before the next report poll: `base` after a round that saw work, else double the
    last wait, capped at `idle_cap` (an idle cluster costs a few calls per second, not 10 per worker)."""
    return min(max(current * 2, base), max(idle_cap, base)) if quiet else base


def quiet_report(report) -> bool:
    """A report of a worker with nothing to do: no sequence running or queued, no KV events, no leases."""
    s = report.stats
    return not (s.running or s.waiting or report.events or report.leases_active)


class WorkerPool:
    def __init__(self, config: ServeConfig, metrics: Metrics, *, report_interval: float = 0.1) -> None:
        self.config = config
        self.metrics = metrics
        self.router = Router(router_config(config), rng=random.Random(0), clock=time.monotonic)
        self.workers: dict[str, WorkerRef] = {}
        self.draining: set[str] = set()
        self.joining: set[str] = set()     # grown, admitted, first report not in yet (not alive, not routed)
        self.deliver: Callable[[str, StepDelta], None] = lambda worker_id, delta: None
        self.on_lost: Callable[[str, BackendError], None] = lambda worker_id, error: None
        self.stats: dict[str, WorkerStats] = {}   # each worker's latest report
        self._streaming: set[str] = set()    # decode workers whose output stream is up
        self._tasks: list[asyncio.Task] = []
        self._consumers: dict[str, asyncio.Task] = {}   # decode worker -> its output stream's consumer
        self._launcher: WorkerLauncher | None = None
        self._background: set[asyncio.Task] = set()
        self._report_interval = report_interval
        self._poll_wait = report_interval
        self._wake = asyncio.Event()    # set by route(): poll at full rate again at once
        self._stopping = False
        # arrivals held while every prefill node is busy (prefill_queue_limit; prefill_gate.py)
        self.gate = PrefillGate(config.prefill_queue_limit, lambda: self.serving("prefill"),
                                on_wait=metrics.prefill_gate_wait.observe, on_depth=metrics.prefill_gate_held.set,
                                on_abandoned=lambda d: self.prefill_ended(d.request_id, False))

    # ---------------------------------------------------------------- life
    async def start(self) -> None:
        self._launcher, refs = await launch_workers(self.config)
        for ref in refs:
            self.router.add_worker(ref.worker_id, ref.pool)
            self._admit(ref)
        self._tasks.append(asyncio.get_running_loop().create_task(self._poll_reports()))

    def _admit(self, ref: WorkerRef) -> None:
        self.workers[ref.worker_id] = ref
        if ref.pool != "prefill":
            self._consumers[ref.worker_id] = asyncio.get_running_loop().create_task(self._consume(ref))

    async def grow(self, pool: str) -> WorkerRef:
        """Start one more worker of `pool`. It is routed to once it is ready and its first
        report (load, and its KV snapshot for the router's index) arrived; until then it
        counts as not alive."""
        assert self._launcher is not None, "start() the pool first"
        ref = self._launcher.create(pool)
        ref.alive = False
        await self._launcher.wait_ready([ref])
        self.joining.add(ref.worker_id)
        self._admit(ref)
        log.info("pool %s grew by %s", pool, ref.worker_id)
        return ref

    def remove(self, worker_id: str) -> None:
        """Stop a worker for good and forget it (scale-in, once drain.retire_worker emptied it)."""
        ref = self.workers.pop(worker_id)
        consumer = self._consumers.pop(worker_id, None)
        if consumer is not None:
            consumer.cancel()
        self.draining.discard(worker_id)
        self.joining.discard(worker_id)
        self._streaming.discard(worker_id)
        self.router.remove_worker(worker_id)
        self.stats.pop(worker_id, None)
        self.metrics.forget_worker(worker_id, ref.pool)
        ref.kill()
        log.info("pool %s shrank: %s left", ref.pool, worker_id)

    def serving(self, pool: str) -> list[str]:
        """The ids of the workers of `pool` ("prefill", or "decode" incl. colocated) that are
        alive and routed."""
        return sorted(w for w, r in self.workers.items() if r.alive and w not in self.draining
                      and (r.pool == "prefill") == (pool == "prefill"))

    def held(self, pool: str) -> list[str]:
        """`serving` and the workers of `pool` grown but not yet routed (`joining`: ready, first
        report not in): what the pool holds for a fleet cap, a new worker counted from the moment
        its start ends, not from its first report."""
        joining = [w for w in self.joining if w in self.workers and w not in self.draining
                   and (self.workers[w].pool == "prefill") == (pool == "prefill")]
        return sorted(set(self.serving(pool)) | set(joining))

    async def stop(self) -> None:
        self._stopping = True
        self.gate.release_all()
        for t in [*self._tasks, *self._consumers.values()]:
            t.cancel()
        await self._shutdown_check()
        for ref in self.workers.values():
            ref.kill()

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
                         st.kv_blocks_used)

    # ------------------------------------------------------------- routing
    def route(self, request_id: str, prompt_len: int, hashes: Iterable[int]) -> RoutingDecision:
        self._wake.set()
        try:
            return self.router.route(RoutingRequest(request_id, prompt_len, tuple(hashes), self.config.block_size))
        except NoWorkerAvailable as e:
            raise BackendError("UNAVAILABLE", f"no worker available: {e}", retry_after_s=1.0) from e

    async def route_gated(self, request_id: str, prompt_len: int, hashes: Iterable[int]) -> RoutingDecision:
        """`route`, once a prefill node has room for the request (the prefill gate: at once when
        it is off, ``prefill_queue_limit`` -1, or for a prompt the decode node prefills itself
        by its length, ``local_prefill_threshold``)."""
        hashes = tuple(hashes)
        return await self.gate.route(lambda: self.route(request_id, prompt_len, hashes), prompt_len,
                                     may_hold=prompt_len > self.config.local_prefill_threshold)

    def prefill_ended(self, request_id: str, computed: bool) -> None:
        """A routed request's prefill ended: the router's in-flight record of it ends (Router.on_prefill_end),
        and the prefill gate counts its tokens off its node (held requests may go there now)."""
        self.router.on_prefill_end(request_id, computed)
        self.gate.ended(request_id)

    def live(self, worker_id: str | None) -> WorkerRef | None:
        ref = self.workers.get(worker_id or "")
        return ref if ref is not None and ref.alive else None

    def other_prefill(self, exclude: Iterable[str]) -> str | None:
        """The least-loaded live prefill node not in `exclude` (draining ones are not live)."""
        return self._least_loaded(self.router.view.prefill, exclude, lambda load: (load.queued_prefill_tokens,))

    def other_decode(self, exclude: Iterable[str]) -> str | None:
        """The least-loaded live decode node not in `exclude`."""
        return self._least_loaded(self.router.view.decode, exclude, lambda load: (load.waiting, load.running))

    def _least_loaded(self, views, exclude: Iterable[str], key) -> str | None:
        skip = set(exclude)
        live = [v for v in views if v.worker_id not in skip and self.workers[v.worker_id].alive]
        return min(live, key=lambda v: (*key(v.load), v.worker_id)).worker_id if live else None

    def unroute(self, worker_id: str) -> None:
        """Stop routing to a worker that stays up (a drain): its reports no longer revive it."""
        self.draining.add(worker_id)
        self.router.on_worker_dead(worker_id)

    def reroute(self, worker_id: str) -> None:
        """Route to it again; its next report resyncs the router."""
        self.draining.discard(worker_id)

    # ---------------------------------------------------------------- calls
    async def call(self, ref: WorkerRef, object_ref: Awaitable[Any]) -> Any:
        """Await a remote call; a failure becomes the BackendError a frontend reports. (A
        request's deadline is the runner's: it cancels the request, and with it this await.)"""
        import ray.exceptions as rex

        try:
            return await object_ref
        except (rex.RayActorError, rex.ActorUnavailableError) as e:
            self.mark_dead(ref)
            raise BackendError("UNAVAILABLE", f"worker {ref.worker_id} died; retry the request") from e
        except rex.RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, ValueError):
                raise BackendError("INVALID_ARGUMENT", str(cause).splitlines()[-1]) from e
            raise BackendError("INTERNAL", f"worker {ref.worker_id} failed: {type(cause).__name__}") from e

    def background(self, awaitable: Awaitable[Any], timeout: float | None = None) -> None:
        """Fire and forget, bounded (a dead worker frees everything anyway)."""
        async def run():
            try:
                await asyncio.wait_for(awaitable, timeout or self.config.transfer_timeout)
            except Exception:
                pass
        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --------------------------------------------------------------- health
    def mark_dead(self, ref: WorkerRef) -> None:
        if not ref.alive:   # already handled: its requests were told once
            return
        log.warning("worker %s is gone; its requests migrate or end with UNAVAILABLE", ref.worker_id)
        ref.alive = False
        self.router.on_worker_dead(ref.worker_id)
        self.metrics.forget_worker(ref.worker_id, ref.pool)
        self.gate.release()          # the last prefill node gone: held requests are routed (decode prefills)
        self.on_lost(ref.worker_id, BackendError(
            "UNAVAILABLE", f"worker {ref.worker_id} died mid-request; retry the request"))

    async def _consume(self, ref: WorkerRef) -> None:
        """Fan out one decode worker's per-step batches; survive its restarts."""
        while not self._stopping:
            try:
                gen = ref.actor.output_stream.options(num_returns="streaming").remote()
                async for obj in gen:
                    batch = await obj
                    ref.alive = True    # the stream's first (empty) batch says it is back
                    self.joining.discard(ref.worker_id)
                    self._streaming.add(ref.worker_id)
                    for delta in batch:
                        self.deliver(ref.worker_id, delta)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("output stream of %s broke: %s", ref.worker_id, type(e).__name__)
                self._streaming.discard(ref.worker_id)
                self.mark_dead(ref)
                await asyncio.sleep(0.5)

    async def _poll_reports(self) -> None:
        while not self._stopping:
            self._wake.clear()
            quiet = await asyncio.gather(*[self._poll_one(ref) for ref in list(self.workers.values())])
            self.gate.release()      # a prefill node back or grown: held requests may go there
            for pool in ("prefill", "decode"):
                self.metrics.pool_workers.labels(pool=pool).set(len(self.serving(pool)))
            self._poll_wait = next_report_interval(self._poll_wait, all(quiet), self._report_interval,
                                                   IDLE_REPORT_INTERVAL_S)
            try:     # a request routed meanwhile (route() sets _wake) ends the wait and the back-off
                await asyncio.wait_for(self._wake.wait(), self._poll_wait)
                self._poll_wait = self._report_interval
            except asyncio.TimeoutError:
                pass

    async def _poll_one(self, ref: WorkerRef) -> bool:
        """Poll one worker's report; True if it was quiet (idle: the poll may back off)."""
        try:
            report = await asyncio.wait_for(ref.actor.report.remote(), REPORT_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:   # slow (a loaded host), not dead: only Ray says dead
            log.info("report of %s timed out; keeping it", ref.worker_id)
            return False
        except Exception:
            self.mark_dead(ref)
            return False
        was_alive = ref.alive
        await self._poll_report(ref, report)
        return was_alive and ref.alive and quiet_report(report)   # a worker coming back is news

    async def _poll_report(self, ref: WorkerRef, report) -> None:
        if ref.worker_id in self.draining or ref.worker_id not in self.workers:   # unrouted, or removed
            return
        if not ref.alive and ref.pool != "prefill" and ref.worker_id not in self._streaming:
            return   # a decode worker is back only once its output stream is (see _consume); a late
            # failure of a call to its previous incarnation must not keep a live one unrouted
        revived = not ref.alive or ref.worker_id not in self.router.index.worker_ids
        ref.alive = True
        self.joining.discard(ref.worker_id)
        result = self.router.on_events(ref.worker_id, report.events)
        if revived or result.needs_resync:
            try:
                snapshot = await asyncio.wait_for(ref.actor.kv_snapshot.remote(), SNAPSHOT_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:   # not in the index yet: the next poll asks again
                log.info("KV snapshot of %s failed (%s); asking again", ref.worker_id, type(e).__name__)
                return
            self.router.on_snapshot(ref.worker_id, snapshot)
        self._observe(ref, report)

    def _observe(self, ref: WorkerRef, report) -> None:
        s = report.stats
        stats = WorkerStats(ref.worker_id, ref.pool, s.running, s.waiting, s.kv_blocks_used, s.kv_blocks_total,
                            s.prefix_queried_tokens, s.prefix_hit_tokens, report.lease_expiries,
                            report.leases_active, s.preemptions, TierStats.from_engine(s),
                            s.prefix_waits, s.prefix_wait_blocks_saved, report.reservation_expiries)
        self.stats[ref.worker_id] = stats
        self.router.observe_stats(stats, queued_prefill_tokens=s.waiting_tokens)
        self.metrics.observe_worker(stats)

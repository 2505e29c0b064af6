"""The live autoscaler: `pdserve serve --autoscale`.

Every `autoscale_interval` it builds the controller's signals from what the
head already measures, asks the controller (cluster/orchestration/autoscale,
the same pure module the simulator runs on its virtual clock) for a target
size per pool, and acts:

- scale-out starts workers (`WorkerPool.grow`: Ray places each where the
  pool's resource and CPUs are free; on KubeRay a pending actor makes the Ray
  autoscaler add a pod). A new worker is routed to only once it is ready and
  its first report and KV snapshot reached the router. Under the fleet cap a
  worker decided while a retiring one still holds its GPU is started once that
  one has left, so both pools never hold more than the cap;
- scale-in retires the least-loaded worker (`drain.retire_worker`: no new
  requests, queued ones move, running ones finish, leases are released, then
  it stops; if it does not empty within `drain_timeout` it serves again).

Signals: queued prefill tokens and loads from the router's view (the workers'
reports); the prompt-token arrival rate from `pdserve_prompt_tokens_total`;
TTFT and ITL p90 over the interval from the frontends' histograms; each decode
worker's own KV use (the router's view of its reports) beside the mean; the TTFT
wait-miss fraction (autoscale/wait_miss.py, the simulator's definition) over the
last `wait_miss_window` from each request's first token (`first_token`: its TTFT
and the prompt tokens its prefill computed, at the per-worker prefill rate the
controller is given), deciding prefill's SLO when `autoscale_ttft_miss_budget` > 0
and a gauge either way. Worker
capacity (prompt tokens/s one prefill worker sustains, sequences one decode
worker holds) is the operator's figure when given
or measured here (capacity.py); `pdserve plan` gives the sequences that fit a worker.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Protocol

from cluster.config import ServeConfig
from cluster.observability.metrics import Metrics
from cluster.orchestration.autoscale.controller import ControllerState, FleetDecision, PoolDecision, decide
from cluster.orchestration.autoscale.signals import (AutoscaleConfig, DecodeSignals, FleetSignals, PoolBounds,
                                                     PrefillSignals)
from cluster.orchestration.autoscale.wait_miss import WaitMisses, prefill_alone_at_rate
from cluster.orchestration.capacity import CapacityEstimate, HistogramWindow
from cluster.orchestration.pool import WorkerPool

log = logging.getLogger("pdserve.autoscale")
POOLS = ("prefill", "decode")


class Resizable(Protocol):
    pool: WorkerPool

    async def grow_pool(self, pool: str) -> str: ...

    async def retire_worker(self, worker_id: str, timeout: float | None = None) -> bool: ...


def autoscale_config(cfg: ServeConfig) -> AutoscaleConfig:
    cool = cfg.autoscale_cooldown_s
    budget = {"ttft_miss_budget": cfg.autoscale_ttft_miss_budget} if cfg.autoscale_ttft_miss_budget > 0 else {}
    return AutoscaleConfig(slo_ttft_ms=cfg.slo_ttft_ms, slo_itl_ms=cfg.slo_itl_ms,
                           prefill=PoolBounds(*cfg.pool_bounds("prefill")),
                           decode=PoolBounds(*cfg.pool_bounds("decode")),
                           predict_ahead_s=cool / 2, scale_in_hold_s=cool, cooldown_out_s=cool / 2,
                           cooldown_in_s=cool, idle_hold_s=cool,
                           max_total_workers=cfg.autoscale_max_total_workers or None, **budget)


def wait_miss_window(cfg: ServeConfig) -> float:
    """Seconds of first tokens the wait-miss fraction covers: the scale-out cool-down (half the
    cool-down; at least one interval), so the misses that caused one scale-out have left the
    window before the next may come (the simulator's benchmark: a 30 s window, 5 s interval)."""
    return max(cfg.autoscale_interval, cfg.autoscale_cooldown_s / 2)


class Autoscaler:
    def __init__(self, backend: Resizable, config: ServeConfig, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend, self.config, self.metrics, self.clock = backend, config, metrics, clock
        self.controller = autoscale_config(config)
        self.state = ControllerState()
        self.capacity = CapacityEstimate(config)
        self._ttft = HistogramWindow(metrics.ttft)
        self._itl = HistogramWindow(metrics.itl)
        self._wait_misses = WaitMisses(wait_miss_window(config))
        self._prompt_tokens: float | None = None
        self._last: float | None = None
        self._last_prompt: float | None = None   # the last sample that saw new prompt tokens
        self._starting = {pool: 0 for pool in POOLS}
        self._retiring: dict[str, str] = {}            # worker id -> pool
        self._booting = 0                              # grows past the fleet cap's gate, not yet held
        self._gpu_freed = asyncio.Event()              # a retired worker left (its GPU is free again)
        self._tasks: set[asyncio.Task] = set()
        self.decisions: list[FleetDecision] = []       # the recent ones, for tests and the admin API
        self.signals: list[FleetSignals] = []          # what each of them saw
        for pool in POOLS:
            self.metrics.pool_target_workers.labels(pool=pool).set(self._workers(pool))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.autoscale_interval)
            try:
                self.step()
            except Exception:   # a decision that fails must not stop the loop
                log.exception("autoscale step failed")

    def step(self) -> FleetDecision:
        now = self.clock()
        signals = self._signals(now)
        decision, self.state = decide(self.controller, signals, self.state, now)
        self.decisions = (self.decisions + [decision])[-100:]
        self.signals = (self.signals + [signals])[-100:]
        for d in decision.pools:
            self._record(d)
            self._act(d)
        return decision

    # -------------------------------------------------------------- signals
    def first_token(self, ttft_s: float, computed_tokens: int) -> None:
        """A request's first token came `ttft_s` after its arrival; its prefill computed
        `computed_tokens` prompt tokens (the prompt less its prefix-cache hit)."""
        alone = prefill_alone_at_rate(computed_tokens, self.capacity.prefill_tokens_per_s())
        self._wait_misses.add(self.clock(), ttft_s, alone, self.config.slo_ttft_ms / 1000.0)

    def _wait_miss(self, now: float) -> float | None:
        """The window's wait-miss fraction, into the gauge; the controller's signal when it decides."""
        miss = self._wait_misses.fraction(now)
        self.metrics.ttft_wait_miss.set(float("nan") if miss is None else miss)
        return miss if self.config.autoscale_ttft_miss_budget > 0 else None

    def _signals(self, now: float) -> FleetSignals:
        view = self.backend.pool.router.view
        dt = (now - self._last) if self._last is not None else 0.0
        self._last = now
        total = self.metrics.registry.get_sample_value("pdserve_prompt_tokens_total") or 0.0
        rate = (total - self._prompt_tokens) / dt if dt > 0 and self._prompt_tokens is not None else 0.0
        if total > (self._prompt_tokens or 0.0):   # a prompt came since the last sample: its age is at most dt
            self._last_prompt = now
        self._prompt_tokens = total
        self.capacity.observe(self.backend.pool, now)
        ttft, itl = self._ttft.quantile(0.9), self._itl.quantile(0.9)
        prefill = PrefillSignals(
            workers=self._workers("prefill"), ready_workers=len(view.prefill),
            queued_tokens=sum(v.load.queued_prefill_tokens for v in view.prefill), prompt_tokens_per_s=rate,
            ttft_p90_ms=None if ttft is None else ttft * 1e3,
            tokens_per_s_per_worker=self.capacity.prefill_tokens_per_s(),
            ttft_wait_miss_fraction=self._wait_miss(now),
            since_last_prompt_s=None if self._last_prompt is None else now - self._last_prompt)
        decode = DecodeSignals(
            workers=self._workers("decode"), ready_workers=len(view.decode),
            running=sum(v.load.running for v in view.decode), waiting=sum(v.load.waiting for v in view.decode),
            kv_usage=(sum(v.load.kv_usage for v in view.decode) / len(view.decode)) if view.decode else 0.0,
            itl_p90_ms=None if itl is None else itl * 1e3, seqs_per_worker=self.capacity.decode_seqs(),
            kv_usage_by_worker=tuple(v.load.kv_usage for v in view.decode))
        return FleetSignals(prefill, decode, draining=len(self._retiring))

    def _workers(self, pool: str) -> int:
        """What the pool holds or is starting, less what it is retiring: the last target acted on."""
        held = [w for w in self.backend.pool.held(pool) if w not in self._retiring]
        return len(held) + self._starting[pool]

    # ---------------------------------------------------------------- acting
    def _record(self, d: PoolDecision) -> None:
        direction = "up" if d.delta > 0 else "down" if d.delta < 0 else "hold"
        self.metrics.autoscale_decisions.labels(pool=d.pool, direction=direction, reason=d.reason.value).inc()
        self.metrics.pool_target_workers.labels(pool=d.pool).set(d.target)
        if d.delta:
            log.info("autoscale %s: %d -> %d workers (%s; predicted load %.1f)", d.pool, d.current, d.target,
                     d.reason.value, d.predicted_load)

    def _act(self, d: PoolDecision) -> None:
        if self.config.colocated and d.pool == "prefill":
            return
        for _ in range(max(0, d.delta)):
            self._starting[d.pool] += 1
            self._spawn(self._grow(d.pool))
        for worker_id in self._victims(d.pool, max(0, -d.delta)):
            self._retiring[worker_id] = d.pool
            self._spawn(self._retire(worker_id))

    def _victims(self, pool: str, n: int) -> list[str]:
        """The least-loaded serving workers of `pool` (newest first among equals)."""
        views = {v.worker_id: v for v in (self.backend.pool.router.view.prefill if pool == "prefill"
                                          else self.backend.pool.router.view.decode)}
        serving = [w for w in self.backend.pool.serving(pool) if w not in self._retiring and w in views]

        def load(w: str) -> tuple:
            v = views[w].load
            return (v.queued_prefill_tokens + v.running + v.waiting, v.kv_usage, _reverse(w))
        return sorted(serving, key=load)[:n]

    def _gpus_in_use(self) -> int:
        """Workers holding a GPU: held by either pool, retiring (draining until they leave) and
        booting."""
        held = set(self.backend.pool.held("prefill")) | set(self.backend.pool.held("decode")) | set(self._retiring)
        return len(held) + self._booting

    async def _gpu_for_a_new_worker(self) -> None:
        """Under the fleet cap (the GPUs the fleet owns) a worker decided at the cap, while the one it
        replaces still drains, starts once that one has left: both pools together never hold more
        than the cap (the simulator's `ClusterSim.provision` models the same)."""
        cap = self.controller.max_total_workers
        while cap is not None and self._gpus_in_use() >= cap:
            self._gpu_freed.clear()
            try:
                await asyncio.wait_for(self._gpu_freed.wait(), timeout=self.config.autoscale_interval)
            except asyncio.TimeoutError:
                pass                                   # look again: a worker may have died meanwhile

    async def _grow(self, pool: str) -> None:
        try:
            await self._gpu_for_a_new_worker()
            self._booting += 1
            try:
                await self.backend.grow_pool("colocated" if self.config.colocated else pool)
            finally:
                self._booting -= 1
        finally:
            self._starting[pool] -= 1

    async def _retire(self, worker_id: str) -> None:
        try:
            await self.backend.retire_worker(worker_id)
        finally:
            self._retiring.pop(worker_id, None)
            self._gpu_freed.set()

    def _spawn(self, work: Awaitable[None]) -> None:
        async def run():
            try:
                await work
            except Exception:
                log.exception("autoscale action failed")
        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()


def _reverse(worker_id: str) -> tuple[int, str]:
    """Sort key: a higher worker number first (the newest worker leaves first)."""
    head, _, num = worker_id.rpartition("-")
    return (-int(num), head) if num.isdigit() else (0, worker_id)

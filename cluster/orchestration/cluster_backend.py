"""ClusterBackend: the frontends' `GenerationBackend` over pools of Ray workers.

It holds the pieces and wires them; the work is theirs:
- `WorkerPool` (pool.py): the worker actors, their health and routing membership,
  report polling, the decode workers' output streams;
- `Handoff` (handoff.py): one request's way from the router through a prefill node
  to a decode node, and its recovery when a worker fails or drains;
- `Journal` (journal.py): what happened to each request, and recovery counters;
- drain.py: taking one worker out of service.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable, Mapping

from cluster.config import ServeConfig
from cluster.observability.metrics import Metrics
from cluster.orchestration.autoscaler import Autoscaler
from cluster.orchestration.backend import BackendError, GenerateJob, GenerationBackend, ModelInfoData
from cluster.orchestration.drain import DrainReport, drain_worker, retire_worker, undrain_worker
from cluster.orchestration.handoff import Handoff, Hooks, Shared
from cluster.orchestration.journal import Journal
from cluster.orchestration.launcher import WorkerRef
from cluster.orchestration.pool import WorkerPool
from cluster.orchestration.rebalance import DecodeRebalancer
from cluster.router.router import Router
from engine.outputs import StepDelta


class ClusterBackend(GenerationBackend):
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
        self.pool = WorkerPool(config, metrics, report_interval=report_interval)
        self.pool.deliver = self._deliver
        self.pool.on_lost = self._worker_lost
        self.journal = Journal()
        self.hooks = Hooks()
        self._in_flight: dict[str, Handoff] = {}   # client request id -> its hand-off
        self._by_wid: dict[str, Handoff] = {}      # worker-side id of each current attempt -> hand-off
        self.autoscaler: Autoscaler | None = None
        self._autoscaling: asyncio.Task | None = None
        self.rebalancer = DecodeRebalancer(self.pool, self._by_wid, config.max_num_seqs,
                                           config.decode_rebalance_interval)
        self._rebalancing: asyncio.Task | None = None
        # each request's first token: (TTFT s, prompt tokens its prefill computed); the autoscaler's
        self._first_token: Callable[[float, int], None] = lambda ttft_s, computed_tokens: None

    # ---------------------------------------------------------------- life
    async def start(self) -> None:
        await self.pool.start()
        if self.config.decode_rebalance_interval > 0:
            self._rebalancing = asyncio.get_running_loop().create_task(self.rebalancer.run())
        if self.config.autoscale:
            self.autoscaler = Autoscaler(self, self.config, self.metrics)
            self._first_token = self.autoscaler.first_token
            self._autoscaling = asyncio.get_running_loop().create_task(self.autoscaler.run())
        else:
            for pool in ("prefill", "decode"):
                self.metrics.pool_target_workers.labels(pool=pool).set(len(self.pool.serving(pool)))

    async def stop(self) -> None:
        if self._rebalancing is not None:
            self._rebalancing.cancel()
        if self._autoscaling is not None and self.autoscaler is not None:
            self._autoscaling.cancel()
            self.autoscaler.stop()
        await self.pool.stop()

    # ------------------------------------------------------------ requests
    async def generate(self, job: GenerateJob) -> AsyncIterator[StepDelta]:
        rid = job.request_id
        if rid in self._in_flight:
            raise BackendError("ALREADY_EXISTS", f"request id {rid!r} is in flight; use a unique id")
        shared = Shared(self.config, self.pool, self.journal, self.metrics, self.hooks, self._by_wid)
        handoff = self._in_flight[rid] = Handoff(shared, job)
        first = True
        try:
            async for delta in handoff.run():
                if first and delta.new_token_ids:
                    first = False
                    self._first_token(time.monotonic() - job.arrival_time,
                                      len(job.prompt_token_ids) - delta.num_cached_tokens)
                yield delta
        finally:
            self._in_flight.pop(rid, None)

    async def abort(self, request_id: str) -> None:
        handoff = self._in_flight.get(request_id)
        if handoff is not None:
            await handoff.abort()

    def _deliver(self, worker_id: str, delta: StepDelta) -> None:
        handoff = self._by_wid.get(delta.request_id)
        if handoff is not None:
            handoff.deliver(worker_id, delta)

    def _worker_lost(self, worker_id: str, error: BackendError) -> None:
        for handoff in self._in_flight.values():
            handoff.worker_lost(worker_id, error)

    # --------------------------------------------------------------- admin
    @property
    def workers(self) -> Mapping[str, WorkerRef]:
        return self.pool.workers

    @property
    def router(self) -> Router:
        return self.pool.router

    @property
    def in_flight(self) -> Mapping[str, Handoff]:
        """Client request id -> its hand-off (tests and admin tools read them)."""
        return self._in_flight

    def request_events(self, request_id: str) -> list[str]:
        return self.journal.request_events(request_id)

    async def drain_worker(self, worker_id: str, timeout: float = 60.0) -> DrainReport:
        """Scale-down one worker: stop routing to it, move its queued requests to other
        workers, let its running ones finish (up to `timeout` seconds)."""
        return await drain_worker(self.pool, self._by_wid, worker_id, timeout)

    async def undrain_worker(self, worker_id: str) -> None:
        """Route to a drained worker again (its next report resyncs the router)."""
        await undrain_worker(self.pool, worker_id)

    async def grow_pool(self, pool: str) -> str:
        """Add one worker to `pool` ("prefill", "decode" or "colocated"); its id."""
        return (await self.pool.grow(pool)).worker_id

    async def retire_worker(self, worker_id: str, timeout: float | None = None) -> bool:
        """Scale-in: drain one worker and stop it for good once it holds nothing; False (and
        it serves again) if it did not empty within `timeout` (default drain_timeout)."""
        return await retire_worker(self.pool, self._by_wid, worker_id, timeout or self.config.drain_timeout)

    # ---------------------------------------------------------------- info
    def model_info(self) -> ModelInfoData:
        pools: dict[str, int] = {}
        for ref in self.pool.workers.values():
            pools[ref.pool] = pools.get(ref.pool, 0) + 1
        name = self.config.served_model_name[0] if self.config.served_model_name else self.model_path.name
        return ModelInfoData(name, self._max_model_len, self.config.block_size,
                             self._vocab_size, pools, tokenizer_vocab_size=self._tokenizer.vocab_size,
                             kv_cache_dtype=self.config.kv_cache_dtype)

    def tokenizer(self):
        return self._tokenizer

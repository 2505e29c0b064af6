"""What both workers share: an engine on its own thread (AsyncEngine), the
transfer settings bound to this node, readiness, reports, step traces, KV
snapshots, integrity checks and the common part of draining. Each worker
adds its role on top (prefill_worker/worker.py, decode_worker/worker.py).

A plain class: the launcher wraps a worker with `ray.remote(...)`, so it also
runs in-process for tests.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv_events import KVSnapshot
from engine.llm_engine import LLMEngine
from kvtransfer.engine import TransferEngine
from kvtransfer.handle import RankSource
from kvtransfer.head_plan import HeadShard, head_shards
from kvtransfer.layout import KVPoolLayout
from kvtransfer.settings import TransferSettings
from worker_api.messages import IntegrityReport, ReadyInfo, WorkerReport

log = logging.getLogger("pdserve.worker")


@dataclass(frozen=True)
class KVHeads:
    """How this worker's KV pool splits the model's KV heads (rank 0's share, with TP)."""
    num_layers: int
    num_kv_heads: int          # the model's
    tp_size: int

    @property
    def shard(self) -> HeadShard:
        """Rank 0's heads (all of them without tensor parallelism)."""
        return head_shards(self.num_kv_heads, self.tp_size)[0]


class WorkerBase:
    def __init__(self, worker_id: str, pool: str, engine_config: EngineConfig, transfer: TransferSettings,
                 torch_threads: int = 1, *, batch_stream: bool = False, tp_ranks: Sequence[Any] = ()) -> None:
        """`tp_ranks`: Ray actor handles of ranks 1..N-1 (worker_api/rank_actor.py) when this
        worker is rank 0 of a tensor-parallel worker."""
        import torch

        from engine.loader.load import load_model_config, resolve_model_path

        torch.set_num_threads(max(1, torch_threads))
        self.worker_id = worker_id
        self.pool = pool
        if not transfer.host:   # a cluster's settings: bind this worker's own node address
            transfer = transfer.on_node(node_address())
        self.settings = transfer
        path = resolve_model_path(engine_config.model or None)
        engine_config = replace(engine_config, model=engine_config.model or str(path))
        model = load_model_config(path)
        self.kv_heads = KVHeads(model.num_layers, model.num_kv_heads, len(tp_ranks) + 1)
        self.tp_actors = list(tp_ranks)
        self.tp_sources: list[RankSource] = []      # ranks 1..N-1's pools (tensor parallel)
        self._tp_serving: list[Any] = []
        if tp_ranks:
            from worker_api.tp_ranks import start_tp_executor
            runner, ranks = start_tp_executor(engine_config, self.tp_actors, transfer.host)
            self.engine = LLMEngine(engine_config, runner=runner)
            self.tp_sources, self._tp_serving = ranks.sources, ranks.serving
        else:
            self.engine = LLMEngine(engine_config)
        self.aengine = AsyncEngine(self.engine, batch_stream=batch_stream)
        self._draining = False
        self._rank_watch: asyncio.Task | None = None

    def _open_transfer(self) -> TransferEngine:
        """This worker's transfer engine, with its KV pool registered for remote reads."""
        engine = self.settings.create(self.worker_id)
        engine.register_pool(KVPoolLayout.from_tensor(self.engine.kv_pool.tensor))
        return engine

    def rank_sources(self, transfer: TransferEngine) -> tuple[RankSource, ...]:
        """Every rank's pool and KV heads, rank 0 (`transfer`) first; () without tensor parallelism."""
        if not self.tp_actors:
            return ()
        return (RankSource(transfer.peer_info(), self.kv_heads.shard), *self.tp_sources)

    # ------------------------------------------------------------- control
    async def ready(self) -> ReadyInfo:
        await self._start()
        return self._ready_info()

    async def _start(self) -> None:
        """Start the engine thread (idempotent): every call that needs the engine awaits it."""
        await self.aengine.start()
        if self._tp_serving and self._rank_watch is None:
            self._rank_watch = asyncio.get_running_loop().create_task(self._watch_ranks())

    async def _watch_ranks(self) -> None:
        """A tensor-parallel rank that dies takes this worker down: exit, so Ray reports it dead
        (its requests are migrated or recomputed) and restarts it with fresh ranks."""
        waits = [asyncio.wrap_future(ref.future()) for ref in self._tp_serving]
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for f in done:
            log.error("worker %s: a tensor-parallel rank stopped (%s): exiting", self.worker_id,
                      f.exception() if not f.cancelled() else "cancelled")
        os._exit(1)

    def _ready_info(self) -> ReadyInfo:
        pool = self.engine.kv_pool
        return ReadyInfo(worker_id=self.worker_id, pool=self.pool, pid=os.getpid(), niceness=os.nice(0),
                         address=self.settings.host, hostname=socket.gethostname(),
                         num_blocks=pool.num_blocks, block_size=self.engine.block_size,
                         kv_cache_dtype=pool.kv_cache_dtype, kv_bytes_per_block=pool.bytes_per_block,
                         tensor_parallel_size=self.kv_heads.tp_size,
                         kv_bytes_per_head_block=pool.bytes_per_block // self.kv_heads.shard.num_heads)

    def undrain(self) -> None:
        self._draining = False

    async def _stop_taking_work(self, abort_first: Sequence[str] = ()) -> list[str]:
        """The common part of `drain`: refuse new work from now on, then on the engine
        thread abort `abort_first` and the queued, unstarted requests; their ids."""
        self._draining = True

        def drain(engine: LLMEngine) -> list[str]:
            for request_id in abort_first:
                engine.abort_request(request_id)
            return engine.abort_unstarted()
        return await self.aengine.call(drain)

    # ----------------------------------------------------------- reporting
    async def report(self) -> WorkerReport:
        engine = await self.aengine.report()
        return WorkerReport(worker_id=self.worker_id, pool=self.pool, stats=engine.stats, events=engine.events)

    def step_trace(self) -> dict[str, Any]:
        """Steps timed since the last call (step_trace_size > 0): see engine/step_trace.py."""
        return {"worker_id": self.worker_id, **self.aengine.step_trace()}

    async def kv_snapshot(self) -> KVSnapshot:
        return await self.aengine.call(lambda e: e.kv_snapshot())

    async def check_integrity(self) -> IntegrityReport:
        """Raise if the engine's pools are inconsistent; return what they hold."""
        def check(engine: LLMEngine) -> IntegrityReport:
            engine.check_integrity()
            s = engine.stats()
            return IntegrityReport(kv_blocks_used=s.kv_blocks_used, running=s.running, waiting=s.waiting,
                                   held=s.held)
        return await self.aengine.call(check)


def node_address() -> str:
    """The address of the Ray node this worker runs on (what peers on other machines reach)."""
    import ray
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"

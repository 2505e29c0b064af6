"""What both workers share: an engine on its own thread (AsyncEngine), the
transfer settings bound to this node, readiness, reports, step traces, KV
snapshots, integrity checks and the common part of draining. Each worker
adds its role on top (prefill_worker/worker.py, decode_worker/worker.py).

A plain class: the launcher wraps a worker with `ray.remote(...)`, so it also
runs in-process for tests.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv_events import KVSnapshot
from engine.llm_engine import LLMEngine
from kvtransfer.engine import TransferEngine
from kvtransfer.layout import KVPoolLayout
from kvtransfer.settings import TransferSettings
from worker_api.messages import IntegrityReport, ReadyInfo, WorkerReport


class WorkerBase:
    def __init__(self, worker_id: str, pool: str, engine_config: EngineConfig, transfer: TransferSettings,
                 torch_threads: int = 1, *, batch_stream: bool = False) -> None:
        import torch

        torch.set_num_threads(max(1, torch_threads))
        self.worker_id = worker_id
        self.pool = pool
        if not transfer.host:   # a cluster's settings: bind this worker's own node address
            transfer = transfer.on_node(node_address())
        self.settings = transfer
        self.engine = LLMEngine(engine_config)
        self.aengine = AsyncEngine(self.engine, batch_stream=batch_stream)
        self._draining = False

    def _open_transfer(self) -> TransferEngine:
        """This worker's transfer engine, with its KV pool registered for remote reads."""
        engine = self.settings.create(self.worker_id)
        engine.register_pool(KVPoolLayout.from_tensor(self.engine.kv_pool.tensor))
        return engine

    # ------------------------------------------------------------- control
    async def ready(self) -> ReadyInfo:
        await self._start()
        return self._ready_info()

    async def _start(self) -> None:
        """Start the engine thread (idempotent): every call that needs the engine awaits it."""
        await self.aengine.start()

    def _ready_info(self) -> ReadyInfo:
        pool = self.engine.kv_pool
        return ReadyInfo(worker_id=self.worker_id, pool=self.pool, pid=os.getpid(), niceness=os.nice(0),
                         address=self.settings.host, hostname=socket.gethostname(),
                         num_blocks=pool.num_blocks, block_size=self.engine.block_size,
                         kv_cache_dtype=pool.kv_cache_dtype, kv_bytes_per_block=pool.bytes_per_block)

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

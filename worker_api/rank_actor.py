"""TPRankActor: rank r >= 1 of a tensor-parallel worker, hosted by a Ray actor.

A TP worker is N Ray actors in one placement group (cluster/orchestration/tp_placement.py):
rank 0 is the ordinary prefill or decode worker, whose engine's model runner is a
:class:`~engine.parallel.executor.TPExecutor`; ranks 1..N-1 are these. Each builds its shard
and its own KV pool (its KV heads only), registers the pool with its own transfer engine (a
decode rank reads its heads straight into it; a prefill rank's pool is read by decode ranks),
then serves rank 0's steps (:meth:`serve`, which blocks: the actor is threaded, so
:meth:`read_heads` runs beside it).

A rank whose group breaks (rank 0 or another rank died) exits its process: Ray restarts it
fresh, and rank 0 (which watches every rank's :meth:`serve`) exits too, so the whole worker
restarts and its requests are migrated or recomputed as for any dead worker.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.loader.load import load_model_config
from engine.parallel.group import TPGroup, rank_device
from engine.parallel.rank import RankMemory, build_rank_runner, rank_memory, serve_rank
from kvtransfer.handle import RankSource
from kvtransfer.head_plan import head_shards
from kvtransfer.head_read import HeadReadResult, read_heads
from kvtransfer.layout import KVPoolLayout
from kvtransfer.settings import TransferSettings

log = logging.getLogger("pdserve.tp")


@dataclass(frozen=True)
class RankReady:
    """A rank with its shard loaded: what it holds and how peers reach its pool."""
    memory: RankMemory
    source: RankSource


class TPRankActor:
    def __init__(self, worker_id: str, rank: int, world_size: int, engine_config: EngineConfig,
                 transfer: TransferSettings, torch_threads: int = 1) -> None:
        import dataclasses

        import torch

        from engine.loader.load import resolve_model_path
        from worker_api.base import node_address

        torch.set_num_threads(max(1, torch_threads))
        engine_config = dataclasses.replace(engine_config, model=str(resolve_model_path(engine_config.model or None)))
        if not transfer.host:
            transfer = transfer.on_node(node_address())
        self.settings = transfer
        # Ray shows each rank only its own GPU: it is cuda:0 here
        self.group = TPGroup(rank=rank, world_size=world_size, device=rank_device(engine_config.device, 0))
        self.runner = build_rank_runner(engine_config, self.group)
        model = load_model_config(engine_config.model)
        self.num_layers = model.num_layers
        self.shard = head_shards(model.num_kv_heads, world_size)[rank]
        self.transfer = transfer.create(f"{worker_id}-rank{rank}")
        self.transfer.register_pool(KVPoolLayout.from_tensor(self.runner.kv_pool.tensor))
        self._serving = threading.Lock()
        threading.Thread(target=self._progress, name="tp-rank-kv", daemon=True).start()

    def ready(self) -> RankReady:
        return RankReady(memory=rank_memory(self.runner, self.group.rank),
                         source=RankSource(self.transfer.peer_info(), self.shard))

    def serve(self, rendezvous: str) -> int:
        """Join rank 0's group and run its steps until it says stop; the steps run."""
        if not self._serving.acquire(blocking=False):
            raise RuntimeError(f"rank {self.group.rank} already serves a group")
        try:
            self.group.connect(rendezvous)
            steps = serve_rank(self.runner, self.group)
        except BaseException:
            log.exception("tensor-parallel rank %d lost its group: exiting (Ray restarts it)", self.group.rank)
            os._exit(1)
        self.group.destroy()
        return steps

    def read_heads(self, sources: Sequence[RankSource], src_ids: Sequence[int],
                   dst_ids: Sequence[int]) -> HeadReadResult:
        """Decode side: read this rank's KV heads of the source's blocks `src_ids` into ours `dst_ids`."""
        return read_heads(self.transfer, sources, self.shard, self.group.rank, self.num_layers, src_ids, dst_ids,
                          self.settings.timeout)

    def _progress(self) -> None:
        """Source side: progress one-sided backends (nixl) and drop notifications (rank 0 keeps the leases)."""
        while True:
            try:
                self.transfer.get_notifications()
            except Exception:
                log.exception("tensor-parallel rank transfer progress")
            time.sleep(0.01)

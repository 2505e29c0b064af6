"""Rank 0's side of a tensor-parallel worker on Ray: ranks 1..N-1 are TPRankActors
(worker_api/rank_actor.py) the launcher placed beside it. :func:`start_tp_executor` builds rank
0's shard while they build theirs, checks their pools agree, then joins the group with them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.parallel.executor import TPExecutor
from engine.parallel.group import Rendezvous, TPGroup, rank_device
from engine.parallel.rank import RankMemory
from kvtransfer.handle import RankSource
from worker_api.rank_actor import RankReady

log = logging.getLogger("pdserve.tp")

READY_TIMEOUT_S = 600.0       # the ranks load their shards
STOP_TIMEOUT_S = 10.0


@dataclass
class RayRanks:
    """Ranks 1..N-1 (Ray actor handles, rank order) as a TPExecutor's ``ranks``."""
    actors: list[Any]
    group: TPGroup                              # rank 0's
    memory: list[RankMemory] = field(default_factory=list)
    sources: list[RankSource] = field(default_factory=list)
    serving: list[Any] = field(default_factory=list)     # each rank's serve() ObjectRef
    _stopped: bool = False

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> list[RankReady]:
        import ray

        try:
            ready: list[RankReady] = ray.get([a.ready.remote() for a in self.actors], timeout=timeout_s)
        except Exception as e:
            raise RuntimeError(f"a tensor-parallel rank failed while loading its shard: {e}") from e
        self.memory = [r.memory for r in ready]
        self.sources = [r.source for r in ready]
        return ready

    def start(self, rendezvous: str) -> None:
        self.serving = [a.serve.remote(rendezvous) for a in self.actors]

    def shutdown(self) -> None:
        """Stop the ranks' step loops and leave the group; never raises. (The actors
        themselves belong to the launcher's placement group.)"""
        if self._stopped:
            return
        self._stopped = True
        if self.group.connected:
            try:
                self.group.broadcast(None)
            except Exception as e:
                log.warning("stopping the tensor-parallel ranks: %s", e)
        self.group.destroy()


def start_tp_executor(config: EngineConfig, actors: list[Any], host: str) -> tuple[TPExecutor, RayRanks]:
    """Rank 0's model runner for ``config`` with ``actors`` as ranks 1..N-1; the group's
    rendezvous binds ``host`` (this node: every rank runs here, one placement group)."""
    n = len(actors) + 1
    if config.tensor_parallel_size != n:
        raise ValueError(f"the engine config asks for tensor_parallel_size={config.tensor_parallel_size} but "
                         f"{n} ranks were placed: pass one rank actor per rank beyond rank 0")
    group = TPGroup(rank=0, world_size=n, device=rank_device(config.device, 0))
    ranks = RayRanks(actors, group)
    executor = TPExecutor(config, group, ranks)          # shard 0 loads while the ranks load theirs
    try:
        ranks.wait_ready()
        executor.check_ranks_agree(ranks.memory)
        meet = Rendezvous.listen(n, host)
        ranks.start(meet.address)
        group.connect(meet)
    except BaseException:
        ranks.shutdown()
        raise
    log.info("tensor parallel worker: %d ranks, %d KV heads each", n, executor.kv_pool.model_config.num_kv_heads)
    return executor, ranks

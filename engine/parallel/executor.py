"""TPExecutor: rank 0's model runner of a tensor-parallel engine.

The engine stays one ordinary :class:`~engine.llm_engine.LLMEngine` (one scheduler, block
manager, prefix cache, KV events: the router sees one worker); only its model runner is
replaced. Each step, rank 0 builds the model inputs from the scheduler's decision, broadcasts
them with the step's block moves to the other ranks (one message per step), and runs its own
shard; the ranks' all-reduces meet inside the forward and the logits are gathered on rank 0,
which samples. A host that runs ranks elsewhere (a Ray actor per rank, later) hands
:meth:`TPExecutor.__init__` its own ``ranks`` object instead of :class:`LocalRanks`.
"""
from __future__ import annotations

import gc
import logging
import weakref
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.parallel.group import Rendezvous, TPGroup, rank_device
from engine.parallel.local_ranks import LocalRanks
from engine.parallel.rank import RankMemory, StepMessage, inputs_to, rank_memory
from engine.parallel.sharded_model import TPShard
from engine.parallel.shard_loader import load_rank_weights
from engine.parallel.sharding import check_tp_size
from engine.scheduler_output import SchedulerOutput
from engine.tiers.types import KVMove

log = logging.getLogger("pdserve.engine.tp")


class Ranks(Protocol):
    """Ranks 1..N-1, wherever they run."""
    memory: list[RankMemory]

    def shutdown(self) -> None: ...


class TPExecutor(ModelRunner):
    def __init__(self, config: EngineConfig, group: TPGroup, ranks: Ranks) -> None:
        """Build rank 0's shard of ``config.model``; the group is joined by :meth:`start`."""
        model_config, layout, state = load_rank_weights(config.model, group.world_size, 0)
        super().__init__(model_config, state, cache_config=config.cache,
                         max_model_len=config.scheduler.max_model_len, device=group.device,
                         dtype=config.dtype, tp=TPShard(layout, group))
        self.group = group
        self.ranks = ranks
        self._finalizer = weakref.finalize(self, ranks.shutdown)     # at exit too

    @classmethod
    def start(cls, config: EngineConfig) -> "TPExecutor":
        """Spawn ranks 1..N-1 on this host (N = ``config.tensor_parallel_size``), build rank 0's
        shard here, wait until every rank has built its own, then join the group."""
        from engine.loader.load import load_model_config

        n = config.tensor_parallel_size
        check_tp_size(load_model_config(config.model), n)
        if dist.is_initialized():
            gc.collect()          # a dropped TP engine in a reference cycle leaves its group when collected
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group: one "
                               "tensor-parallel engine per process (close() the other LLM first)")
        meet = Rendezvous.listen(n)
        group = TPGroup(rank=0, world_size=n, device=rank_device(config.device, 0))
        ranks = LocalRanks.spawn(config, group, meet.address)
        try:
            executor = cls(config, group, ranks)
            others = ranks.wait_ready()
            executor.check_ranks_agree(others)
            group.connect(meet)
        except BaseException:
            ranks.shutdown()
            raise
        log.info("tensor parallel: %d ranks, %d KV heads each, %d blocks", n,
                 executor.kv_pool.model_config.num_kv_heads, executor.num_blocks)
        return executor

    def check_ranks_agree(self, others: list[RankMemory]) -> None:
        """Block ids mean the same block everywhere: every pool must have the same blocks."""
        mine = rank_memory(self, 0)
        for m in others:
            if (m.num_blocks, m.kv_pool_bytes) != (mine.num_blocks, mine.kv_pool_bytes):
                raise RuntimeError(f"rank {m.rank}'s KV pool ({m.num_blocks} blocks, {m.kv_pool_bytes} B) "
                                   f"differs from rank 0's ({mine.num_blocks} blocks, {mine.kv_pool_bytes} B)")

    def memory_per_rank(self) -> list[RankMemory]:
        """Weights and KV pool bytes each rank measured on itself, rank 0 first."""
        return [rank_memory(self, 0), *self.ranks.memory]

    @torch.inference_mode()
    def apply_kv_moves(self, moves: list[KVMove]) -> None:
        if moves:
            self.group.broadcast(StepMessage(list(moves), None))
        super().apply_kv_moves(moves)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """As ModelRunner.execute, after sending the step to the other ranks. ``on_layer`` is
        not called: rank 0's layers say nothing of the other ranks' (the engine passes none)."""
        moves = sched.moves()
        inputs = None if sched.is_empty else self.build_inputs(sched)
        self.group.broadcast(StepMessage(moves, None if inputs is None else inputs_to(inputs, "cpu")))
        return self.run(moves, inputs)

    def close(self) -> None:
        """Stop the other ranks and leave the group; idempotent."""
        self._finalizer()

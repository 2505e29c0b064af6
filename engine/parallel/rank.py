"""What a tensor-parallel rank runs, whoever hosts it (a spawned process today, a Ray actor
later): build its shard, then run each step rank 0 broadcasts until rank 0 says stop.

A step is one :class:`StepMessage`: the block moves (copy-on-write, page-ins / outs) and the
model inputs rank 0 built from its scheduler's decision (token ids, positions, slot mapping,
block tables, ...). Block ids mean the same block on every rank, so the moves and tables
apply as they are to each rank's own pool (its own KV heads).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.batch import AttentionMetadata, BatchInput
from engine.config import EngineConfig
from engine.model_runner import ModelRunner, StepInputs
from engine.parallel.group import TPGroup
from engine.parallel.sharded_model import TPShard
from engine.parallel.shard_loader import load_rank_weights
from engine.tiers.types import KVMove


@dataclass(frozen=True)
class StepMessage:
    """One engine step for the other ranks (``inputs`` on the CPU; None: moves only)."""
    moves: list[KVMove]
    inputs: StepInputs | None


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds, measured on it."""
    rank: int
    weight_bytes: int          # its parameters (the shard)
    kv_pool_bytes: int         # its KV pool tensor
    num_blocks: int
    kv_heads: int              # KV heads in its pool


def _tensors_to(obj, device: torch.device | str):
    """A copy of a dataclass of tensors with every tensor field moved to ``device``."""
    changes = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            changes[f.name] = v.to(device)
    return dataclasses.replace(obj, **changes)


def inputs_to(inputs: StepInputs, device: torch.device | str) -> StepInputs:
    """``inputs`` with every tensor on ``device`` (the same object when already there)."""
    batch = inputs.batch
    if batch.input_ids.device == torch.device(device):
        return inputs
    attn: AttentionMetadata = _tensors_to(batch.attn, device)
    moved: BatchInput = dataclasses.replace(_tensors_to(batch, device), attn=attn)
    return dataclasses.replace(inputs, batch=moved)


def build_rank_runner(config: EngineConfig, group: TPGroup) -> ModelRunner:
    """This rank's model runner: its shard of ``config.model`` and its own KV pool."""
    model_config, layout, state = load_rank_weights(config.model, group.world_size, group.rank)
    return ModelRunner(model_config, state, cache_config=config.cache, max_model_len=config.scheduler.max_model_len,
                       device=group.device, dtype=config.dtype, tp=TPShard(layout, group),
                       attention_backend=config.attention_backend)


def rank_memory(runner: ModelRunner, rank: int) -> RankMemory:
    pool = runner.kv_pool
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return RankMemory(rank=rank, weight_bytes=weights, kv_pool_bytes=pool.tensor.numel() * pool.tensor.element_size(),
                      num_blocks=pool.num_blocks, kv_heads=pool.model_config.num_kv_heads)


def serve_rank(runner: ModelRunner, group: TPGroup) -> int:
    """Run rank 0's steps on this rank's shard until rank 0 broadcasts None; returns the steps run."""
    steps = 0
    while True:
        msg = group.broadcast(None)
        if msg is None:
            return steps
        if not isinstance(msg, StepMessage):
            raise RuntimeError(f"rank {group.rank} got {type(msg).__name__} instead of a StepMessage")
        runner.run(msg.moves, None if msg.inputs is None else inputs_to(msg.inputs, runner.device))
        steps += 1

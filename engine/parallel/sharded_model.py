"""One rank's shard of the Llama-family decoder (layout in engine/parallel/sharding.py).

The decoder layers are the plain model's, built from the rank's local config (its heads, KV
heads and FFN columns) with an all-reduce after o_proj and down. This class adds the
vocabulary-parallel ends: the embedding looks up only the rank's rows (others contribute
zeros) and sums over the ranks; the LM head computes the rank's slice of the logits and
gathers the slices on rank 0, which alone samples.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.parallel.group import TPGroup
from engine.parallel.sharding import ShardLayout


class ShardedLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, model: ModelConfig, layout: ShardLayout, group: TPGroup, attention: AttentionBackend, *,
                 device: torch.device | str, dtype: torch.dtype, max_positions: int | None = None) -> None:
        super().__init__(layout.local_config(model), attention, device=device, dtype=dtype,
                         max_positions=max_positions, reduce=group.all_reduce)
        self.full_config = model
        self.layout = layout
        self.group = group

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.layout.vocab_start
        outside = (local < 0) | (local >= self.layout.vocab_shard)
        h = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        return self.group.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0.0))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Rank 0: ``[N, vocab]`` (the padding rows dropped); other ranks: their own slice."""
        return self.group.gather_last_dim(F.linear(h, self.lm_head_weight))[:, :self.layout.vocab_size]

    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters (what the planner calls weights per rank)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


@dataclass(frozen=True)
class TPShard:
    """What a model runner needs to hold one rank's shard: the layout and the group."""
    layout: ShardLayout
    group: TPGroup

    def local_config(self, model: ModelConfig) -> ModelConfig:
        return self.layout.local_config(model)

    def build_model(self, model: ModelConfig, state_dict: dict[str, torch.Tensor], attention: AttentionBackend, *,
                    device: torch.device | str, dtype: torch.dtype,
                    max_positions: int | None = None) -> ShardedLlamaForCausalLM:
        """The shard of ``model`` (the whole model's config) from ``state_dict``: this rank's
        slices, HF-named (engine/parallel/shard_loader.py, or sharding.shard_state_dict)."""
        m = ShardedLlamaForCausalLM(model, self.layout, self.group, attention, device=device, dtype=dtype,
                                    max_positions=max_positions)
        m.load_hf_state_dict(state_dict)
        return m

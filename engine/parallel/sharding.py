"""Megatron-style tensor-parallel sharding of a Llama-family decoder: pure functions.

Rank ``r`` of ``N`` holds:

- attention heads ``[r*H/N, (r+1)*H/N)`` of q_proj (rows) and o_proj (columns);
- KV heads: ``K/N`` of them (rows of k_proj / v_proj, and the heads of its own KV pool) when
  ``N`` divides the ``K`` KV heads; when ``N`` is a multiple of ``K`` each rank holds one KV
  head, the one its query heads read (head ``r // (N/K)``), so every KV head is replicated on
  ``N/K`` ranks. Any other ``N`` is refused (:func:`check_tp_size` names the sizes that work);
- SwiGLU: rows ``[r*I/N, (r+1)*I/N)`` of gate/up (column-parallel) and those columns of down
  (row-parallel); o_proj and down are each followed by one all-reduce;
- the vocabulary: rows ``[r*ceil(V/N), ...)`` of the embedding and the LM head (zero-padded
  to equal shards). The vocabulary projection is *sharded*, not replicated: in the models
  that need TP it is a large share of the weights (Qwen2's 152k x 8192 table is 1.2B
  parameters per copy; a tiny model's table is most of it), replicating it would break the
  "weights / N per rank" the planner and the seeds count on, and it costs one all-reduce of
  the embedded tokens (the size of a layer's) plus a gather of the sampled rows' logits to
  rank 0, the only rank that samples. RMSNorm weights are replicated (a few KiB).

Block tables are the same on every rank: a rank's pool has the same number of blocks, each
holding only that rank's KV heads.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.config import ModelConfig


def is_valid_tp_size(num_heads: int, num_kv_heads: int, intermediate_size: int, tp: int) -> bool:
    """Whether ``tp`` ranks can split this model (see the module docstring)."""
    if tp < 1 or num_heads % tp or intermediate_size % tp:
        return False
    return num_kv_heads % tp == 0 or tp % num_kv_heads == 0


def valid_tp_sizes(model: ModelConfig) -> list[int]:
    """Every tensor-parallel size this model can run with (1 .. num_heads)."""
    return [n for n in range(1, model.num_heads + 1)
            if is_valid_tp_size(model.num_heads, model.num_kv_heads, model.intermediate_size, n)]


def check_tp_size(model: ModelConfig, tp: int) -> None:
    """ValueError naming the sizes that work when ``tp`` cannot split ``model``."""
    if is_valid_tp_size(model.num_heads, model.num_kv_heads, model.intermediate_size, tp):
        return
    sizes = ", ".join(str(n) for n in valid_tp_sizes(model))
    raise ValueError(
        f"tensor_parallel_size={tp} cannot split {model.name!r} ({model.num_heads} attention heads, "
        f"{model.num_kv_heads} KV heads, intermediate size {model.intermediate_size}): it must divide "
        f"the attention heads and the intermediate size, and either divide the KV heads or be a "
        f"multiple of them (then each KV head is replicated). Use one of: {sizes}")


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads in one rank's pool: ``K/N``, or 1 (replicated) once ``N`` exceeds ``K``."""
    return max(1, num_kv_heads // tp)


def kv_replication(num_kv_heads: int, tp: int) -> int:
    """Ranks that hold each KV head (1 = no replication)."""
    return max(1, tp // num_kv_heads)


@dataclass(frozen=True)
class ShardLayout:
    """What rank ``rank`` of ``tp`` holds (head, row and vocabulary ranges of the full model)."""
    tp: int
    rank: int
    head_start: int
    num_heads: int            # attention heads on this rank
    kv_head_start: int
    num_kv_heads: int         # KV heads on this rank (its pool's heads)
    ffn_start: int
    ffn_size: int             # intermediate columns on this rank
    vocab_start: int
    vocab_shard: int          # rows of the embedding / LM head on this rank (padded)
    vocab_size: int           # the full vocabulary

    @classmethod
    def of(cls, model: ModelConfig, tp: int, rank: int) -> "ShardLayout":
        check_tp_size(model, tp)
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is outside the tensor-parallel group of {tp}: use 0..{tp - 1}")
        heads, ffn = model.num_heads // tp, model.intermediate_size // tp
        kv = kv_heads_per_rank(model.num_kv_heads, tp)
        kv_start = rank * kv if model.num_kv_heads >= tp else rank // kv_replication(model.num_kv_heads, tp)
        shard = -(-model.vocab_size // tp)
        return cls(tp=tp, rank=rank, head_start=rank * heads, num_heads=heads, kv_head_start=kv_start,
                   num_kv_heads=kv, ffn_start=rank * ffn, ffn_size=ffn, vocab_start=rank * shard,
                   vocab_shard=shard, vocab_size=model.vocab_size)

    def local_config(self, model: ModelConfig) -> ModelConfig:
        """The config of this rank's shard: its heads, FFN columns and vocabulary rows."""
        return replace(model, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       intermediate_size=self.ffn_size, vocab_size=self.vocab_shard)


@dataclass(frozen=True)
class Slice:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, start + length)`` of one tensor; with
    ``pad_to`` the rows past the tensor's end are zeros (the last vocabulary shard)."""
    dim: int
    start: int
    length: int
    pad_to: int = 0


def slice_for(name: str, model: ModelConfig, layout: ShardLayout) -> Slice | None:
    """What rank ``layout.rank`` keeps of the HF-named tensor ``name``; None: the whole tensor."""
    hd = model.head_dim
    q = (layout.head_start * hd, layout.num_heads * hd)
    kv = (layout.kv_head_start * hd, layout.num_kv_heads * hd)
    ffn = (layout.ffn_start, layout.ffn_size)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return Slice(0, layout.vocab_start, layout.vocab_shard, pad_to=layout.vocab_shard)
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return Slice(0, *q)
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                      "self_attn.v_proj.weight", "self_attn.v_proj.bias")):
        return Slice(0, *kv)
    if name.endswith("self_attn.o_proj.weight"):
        return Slice(1, *q)
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return Slice(0, *ffn)
    if name.endswith("mlp.down_proj.weight"):
        return Slice(1, *ffn)
    if name.endswith(("o_proj.bias", "down_proj.bias")):
        raise ValueError(f"{name}: a bias after a row-parallel projection is not supported under "
                         "tensor parallelism; use tensor_parallel_size=1")
    return None


def take(t, sl: Slice | None, size: int) -> torch.Tensor:
    """``sl`` of ``t`` (a tensor, or a lazy safetensors slice ``size`` long in ``sl.dim``)."""
    if sl is None:
        return t[:]
    n = max(0, min(sl.length, size - sl.start))
    part = t[sl.start:sl.start + n] if sl.dim == 0 else t[:, sl.start:sl.start + n]
    if not sl.pad_to or n == sl.pad_to:
        return part
    out = torch.zeros(sl.pad_to, *part.shape[1:], dtype=part.dtype)
    out[:n] = part
    return out


def shard_state_dict(sd: dict[str, torch.Tensor], model: ModelConfig,
                     layout: ShardLayout) -> dict[str, torch.Tensor]:
    """This rank's slices of an HF-named state dict (names kept; norms and unknown tensors whole)."""
    out = {}
    for name, t in sd.items():
        sl = slice_for(name, model, layout)
        out[name] = t if sl is None else take(t, sl, t.shape[sl.dim])
    return out

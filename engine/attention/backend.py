"""Attention backends: an abstract class plus implementations chosen by name.

A backend owns the layout *inside* a KV block (``[2, kv_heads, block_size,
head_dim]`` for the torch backend) and two steps:

- ``plan(attn, kv_pool)``: once per forward, turn the step's
  :class:`~engine.batch.AttentionMetadata` into index tensors and masks that
  every layer shares;
- ``forward(plan, layer, q, k, v)``: write this layer's new K/V into the pool
  at ``slot_mapping`` and return the attention output ``[T, heads*head_dim]``;
  ``forward_qkv(plan, layer, qkv, rope)`` is what the model calls: RoPE on the fused
  projection's q and k, then ``forward`` (``cpu_paged`` does both in one op);
- ``kernel_step_args(plan)``: the plan's tensors for the C++ decoder-layer stack
  (engine/model/layer_stack.py), where the backend's kernels can run a step's layers
  without Python between them (``cpu_paged``, float32); ``None`` elsewhere.

With a quantized cache (``kv_spec.quantized``) the backend quantizes K/V as
it writes them and dequantizes what it reads (:mod:`engine.kv_quant`).
"""
from __future__ import annotations

import functools
import importlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import torch

from engine.attention.rotary import apply_rotary
from engine.batch import AttentionMetadata
from engine.kv_quant import KVCacheSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


PlanT = TypeVar("PlanT")      # a backend's per-step plan


@dataclass(frozen=True)
class KernelStepArgs:
    """What ``torch.ops.pdserve.decoder_layers`` needs of a step's plan: the K/V write's slots
    and the paged attention's tables (csrc/decoder_layers.cpp)."""
    pool: torch.Tensor             # [blocks, layers, 2, kv_heads, block_size, head_dim], float32
    slot_mapping: torch.Tensor     # int64 [T]
    block_tables: torch.Tensor     # int64 [S, MB]
    query_start_loc: torch.Tensor  # int64 [S+1]
    context_lens: torch.Tensor     # int64 [S]
    scale: float


class AttentionBackend(ABC, Generic[PlanT]):
    name: str = "abstract"

    def __init__(self, shape: AttentionShape, kv_spec: KVCacheSpec | None = None) -> None:
        self.shape = shape
        self.kv_spec = kv_spec or KVCacheSpec()

    @abstractmethod
    def plan(self, attn: AttentionMetadata, kv_pool: torch.Tensor) -> PlanT:
        """Per-step state shared by all layers (index tensors, masks, pool views)."""

    @abstractmethod
    def forward(self, plan: PlanT, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, KVH, D]`` (post-RoPE) -> output ``[T, H*D]``."""

    def forward_qkv(self, plan: PlanT, layer: int, qkv: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The fused projection's output ``qkv [T, (H + 2*KVH) * D]`` (pre-RoPE) and the step's
        RoPE tables ``(cos, signed_sin) [T, 1, D]`` -> output ``[T, H*D]``: rotate q and k,
        then :meth:`forward`. A backend may fuse the rotation with its K/V write."""
        s = self.shape
        t, nh, nkv, hd = qkv.shape[0], s.num_heads, s.num_kv_heads, s.head_dim
        qk = apply_rotary(qkv[:, :(nh + nkv) * hd].view(t, nh + nkv, hd), *rope)
        v = qkv[:, (nh + nkv) * hd:].view(t, nkv, hd)
        return self.forward(plan, layer, qk[:, :nh], qk[:, nh:], v)

    def kernel_step_args(self, plan: PlanT) -> KernelStepArgs | None:
        """The plan's tensors when this step's layers can run in the C++ layer stack (the
        cpu_paged kernel's float32 plans); ``None``: the model's Python loop runs them."""
        return None


# name -> "module:Class"; imported lazily so optional backends cost nothing
_BACKENDS = MappingProxyType({
    "torch_paged": "engine.attention.torch_paged:TorchPagedAttention",
    "cpu_paged": "engine.attention.cpu_paged:CpuPagedAttention",
})
AUTO = "auto"     # cpu_paged where its kernel builds, else torch_paged


def available_backends() -> tuple[str, ...]:
    return tuple(_BACKENDS)


@functools.lru_cache(maxsize=1)
def _auto_backend() -> str:
    from engine.attention.kernels import load_cpu_kernel

    why = load_cpu_kernel()
    if why is None:
        return "cpu_paged"
    log.warning("attention: the cpu_paged kernel did not build (%s); falling back to torch_paged", why)
    return "torch_paged"


def resolve_backend_name(name: str) -> str:
    """``auto`` -> the backend it stands for on this machine; other names as they are."""
    return _auto_backend() if name == AUTO else name


def get_attention_backend(name: str, shape: AttentionShape, kv_spec: KVCacheSpec | None = None) -> AttentionBackend[Any]:
    name = resolve_backend_name(name)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of "
                         f"{AUTO}, {', '.join(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(shape, kv_spec)

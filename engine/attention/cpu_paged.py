"""Paged attention on the CPU that reads K/V straight from the pool (``cpu_paged``).

A C++ kernel (``csrc/paged_attention.cpp``, built on first use by
:mod:`engine.attention.kernels`) walks each sequence's block table and attends over
the pool's tiles in place: no gathered copy of the context, no padded batch or mask.
One call per layer covers the whole step, fresh prompts, prefill-like sequences
(varlen queries, causal with a cached prefix) and decodes alike; decodes with few
sequences split their context over the cores (flash-decoding). (Fresh prompts once
went to causal SDPA on their new K/V; the kernel is now ~2x faster for them: 2.8 vs
6.2 ms for a 512-token prompt a layer, 1 thread, docs/benchmarks.md.)

What the kernel does not cover falls back to :class:`TorchPagedAttention` per step:
quantized pools (int8/fp8, :mod:`engine.kv_quant`), float16, non-CPU pools, head
dims other than 16, 32, 64 and 128, and block sizes that are not a multiple of 16.

The kernel's vectors are 16 floats with AVX-512 and 8 elsewhere. It runs every step, prefill
and decode, on both: with 8 (AVX2) its prefill once measured 1.3-2.2x slower than the gather +
SDPA torch_paged runs, and steps with prefill went to torch_paged; with its softmax on whole
vectors it is level with torch_paged on long prompts and faster on short ones (32 x 512-token
prompts: 519 vs 470 prompt tok/s), and its decodes 3x faster (docs/benchmarks.md, "The kernel
on 8-float vectors, tuned"). ``prefill_in_kernel=False`` keeps that split, for measuring.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionShape, KernelStepArgs
from engine.attention.kernels import load_cpu_kernel
from engine.attention.pool_views import PlainPoolView
from engine.attention.torch_paged import TorchPagedAttention, TorchPagedPlan
from engine.batch import AttentionMetadata
from engine.kv_quant import KVCacheSpec

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_HEAD_DIMS = (16, 32, 64, 128)


@dataclass
class CpuPagedPlan:
    pool: torch.Tensor           # the raw pool [blocks, layers, 2, kv_heads, block_size, head_dim]
    writer: PlainPoolView        # forward()'s K/V write (forward_qkv writes inside its op)
    write_tiles: torch.Tensor    # int64 [L, 2, T, KVH]
    write_slots: torch.Tensor    # int64 [T, KVH]
    slot_mapping: torch.Tensor   # int64 [T]
    block_tables: torch.Tensor   # int64 [S, MB]
    query_start_loc: torch.Tensor  # int64 [S+1]
    context_lens: torch.Tensor   # int64 [S]


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu_paged"

    def __init__(self, shape: AttentionShape, kv_spec: KVCacheSpec | None = None, *,
                 prefill_in_kernel: bool = True) -> None:
        """``prefill_in_kernel``: whether steps with prefill work run in the kernel too (False: they
        go to torch_paged and only decode-only steps to the kernel, see the module docstring)."""
        super().__init__(shape, kv_spec)
        self.prefill_in_kernel = prefill_in_kernel
        why = load_cpu_kernel()
        if why is not None:
            raise RuntimeError(f"the cpu_paged attention kernel did not build ({why}); install g++ and "
                               f"ninja, or choose attention_backend='torch_paged'")

    def handles(self, kv_pool: torch.Tensor) -> bool:
        s = self.shape
        return (kv_pool.device.type == "cpu" and not self.kv_spec.quantized
                and kv_pool.dtype in _KERNEL_DTYPES and s.head_dim in _HEAD_DIMS and s.block_size % 16 == 0)

    def plan(self, attn: AttentionMetadata, kv_pool: torch.Tensor) -> CpuPagedPlan | TorchPagedPlan:  # type: ignore[override]
        if not self.handles(kv_pool) or (attn.num_prefills and not self.prefill_in_kernel):
            return super().plan(attn, kv_pool)
        s = self.shape
        assert attn.block_size == s.block_size, "metadata block size differs from the pool's"
        tiles, slots = self._write_tiles(attn.slot_mapping)
        return CpuPagedPlan(
            pool=kv_pool, writer=PlainPoolView(kv_pool, s.block_size, s.head_dim),
            write_tiles=tiles, write_slots=slots, slot_mapping=attn.slot_mapping.contiguous(),
            block_tables=attn.block_tables.contiguous(), query_start_loc=attn.query_start_loc.contiguous(),
            context_lens=attn.context_lens.contiguous())

    def forward_qkv(self, plan: CpuPagedPlan | TorchPagedPlan, layer: int, qkv: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE and the K/V write in one op (csrc/rotary_kv.cpp, q and k rotated in place in
        ``qkv``), then the attention on a strided view of its q: no copies of q, k or v."""
        if isinstance(plan, TorchPagedPlan):
            return super().forward_qkv(plan, layer, qkv, rope)
        if qkv.dtype != torch.float32:      # the op rounds RoPE as float32 transformers does;
            # the generic path rotates in torch and calls self.forward, which takes either plan
            return super().forward_qkv(plan, layer, qkv, rope)  # type: ignore[arg-type]
        s = self.shape
        t, nh, hd = qkv.shape[0], s.num_heads, s.head_dim
        cos, ssin = rope
        torch.ops.pdserve.rotary_kv_write(qkv, cos.reshape(t, hd), ssin.reshape(t, hd), plan.slot_mapping,
                                          plan.pool, layer, nh)
        q = qkv[:, :nh * hd].view(t, nh, hd)
        return self._attend(plan, layer, q)

    def forward(self, plan: CpuPagedPlan | TorchPagedPlan, layer: int, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if isinstance(plan, TorchPagedPlan):
            return super().forward(plan, layer, q, k, v)
        tiles = plan.write_tiles[layer]
        plan.writer.write(tiles[0], plan.write_slots, k)
        plan.writer.write(tiles[1], plan.write_slots, v)
        return self._attend(plan, layer, q)

    def kernel_step_args(self, plan: CpuPagedPlan | TorchPagedPlan) -> KernelStepArgs | None:
        if not isinstance(plan, CpuPagedPlan) or plan.pool.dtype != torch.float32:
            return None
        return KernelStepArgs(pool=plan.pool, slot_mapping=plan.slot_mapping, block_tables=plan.block_tables,
                              query_start_loc=plan.query_start_loc, context_lens=plan.context_lens,
                              scale=self.shape.scale)

    def _attend(self, plan: CpuPagedPlan, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention once this layer's K/V are in the pool; q may have strided rows."""
        if not plan.context_lens.shape[0]:
            raise ValueError("an empty step: plan() needs at least one scheduled token")
        qd = q if q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] else q.contiguous()
        out = torch.ops.pdserve.paged_attention(qd, plan.pool, layer, plan.block_tables, plan.query_start_loc,
                                                plan.context_lens, self.shape.scale)
        return out.view(-1, self.shape.num_heads * self.shape.head_dim)

"""RoPE applied in torch (HF's "rotate half" convention), for backends without a fused op.

With the tables of :class:`engine.model.rope.RotaryEmbedding` (``signed_sin = cat(-sin, sin)``)
and ``swap(x) = cat(x2, x1)`` (halves exchanged), HF's ``x*cos + rotate_half(x)*sin`` is
``x*cos + swap(x)*signed_sin``, bit for bit in float32 (csrc/rotary_kv.cpp rounds the same
way); other dtypes keep one fused ``addcmul``.
"""
from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by the per-token tables ``[T, 1, head_dim]``."""
    half = x.shape[-1] // 2
    swapped = torch.roll(x, shifts=half, dims=-1)
    if x.dtype == torch.float32:
        # two products and a sum, each rounded, as transformers computes it (addcmul fuses the
        # second product into the sum: a last-bit difference that can flip a greedy near-tie)
        return (x * cos).add_(swapped.mul_(signed_sin))
    return torch.addcmul(x * cos, swapped, signed_sin)

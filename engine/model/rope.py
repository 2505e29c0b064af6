"""Rotary position embeddings (HF "rotate half" convention).

cos/sin tables are computed once, in float32 as transformers does, for every
position up to ``max_positions``, and then only indexed by position per step. The
attention backend applies them (``AttentionBackend.forward_qkv``: the CPU kernel rotates
q and k as it writes K/V into the pool; engine/attention/rotary.py otherwise).
Supports plain RoPE and the ``linear`` and ``llama3`` rope_scaling types.
"""
from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """float32 [head_dim/2] inverse frequencies, with rope_scaling applied."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


def _llama3(inv: torch.Tensor, sc: dict) -> torch.Tensor:
    factor = float(sc["factor"])
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_len = float(sc["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Holds ``cos`` and ``signed_sin`` tables ``[max_positions, head_dim]``.

    With ``signed_sin = cat(-sin, sin)`` and ``swap(x) = cat(x2, x1)`` (halves
    exchanged), HF's ``x*cos + rotate_half(x)*sin`` is ``x*cos + swap(x)*signed_sin``.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 *, device: torch.device | str, dtype: torch.dtype) -> None:
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        cos, sin = freqs.cos(), freqs.sin()
        self.cos = torch.cat([cos, cos], dim=-1).to(device=device, dtype=dtype)
        self.signed_sin = torch.cat([-sin, sin], dim=-1).to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) ``[T, 1, head_dim]`` for int64 ``positions [T]``; once per step."""
        return (self.cos.index_select(0, positions).unsqueeze(1),
                self.signed_sin.index_select(0, positions).unsqueeze(1))


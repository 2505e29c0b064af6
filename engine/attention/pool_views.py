"""How the torch paged backend writes K/V into the pool and reads tiles back.

A *tile* is one (block, layer, k|v, kv head): ``block_size`` tokens of
``head_dim`` values. Writes address tokens by tile and slot; reads gather
whole tiles and return them as ``[rows, block_size * head_dim]`` in the model
dtype. :class:`PlainPoolView` stores K/V as they are; :class:`QuantPoolView`
quantizes on write and dequantizes on read (layout in :mod:`engine.kv_quant`).
"""
from __future__ import annotations

import torch

from engine.kv_quant import SCALE_DTYPE, KVCacheSpec, KVCodec


class PlainPoolView:
    """K/V at the model's dtype: the pool is ``[tiles, block_size, head_dim]``."""

    def __init__(self, pool: torch.Tensor, block_size: int, head_dim: int) -> None:
        self.tokens = pool.view(-1, block_size, head_dim)
        self.tiles = pool.view(-1, block_size * head_dim)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What a read returns for values ``x`` just written: ``x`` itself."""
        return x

    def write(self, tile: torch.Tensor, slot: torch.Tensor, x: torch.Tensor) -> None:
        self.tokens.index_put_((tile, slot), x)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        return self.tiles.index_select(0, rows)

    def gather_unscaled(self, rows: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Tiles and their per-token scales (none here: the values are the K/V)."""
        return self.gather(rows), None


class QuantPoolView:
    """int8 / fp8 codes plus one bfloat16 scale per token in each tile."""

    def __init__(self, pool: torch.Tensor, block_size: int, head_dim: int, spec: KVCacheSpec,
                 codec: KVCodec) -> None:
        assert pool.dtype == torch.uint8, "a quantized pool is a uint8 tensor"
        self.codes_bytes = block_size * head_dim
        self.block_size, self.head_dim = block_size, head_dim
        self.dtype = spec.model_dtype
        self.codec = codec
        self.tiles = pool.view(-1, spec.tile_bytes(block_size, head_dim))
        self.codes = self.tiles[:, :self.codes_bytes].view(-1, block_size, head_dim)
        self.scales = self.tiles[:, self.codes_bytes:].view(SCALE_DTYPE)        # [tiles, block_size]

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.codec.roundtrip(x)

    def write(self, tile: torch.Tensor, slot: torch.Tensor, x: torch.Tensor) -> None:
        codes, scale = self.codec.quantize(x)
        self.codes.index_put_((tile, slot), codes)
        self.scales.index_put_((tile, slot), scale)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        values, scale = self.gather_unscaled(rows)
        values.view(-1, self.block_size, self.head_dim).mul_(scale.unsqueeze(-1))
        return values

    def gather_unscaled(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded codes ``[rows, block_size * head_dim]`` and scales ``[rows, block_size]`` in the
        model dtype, not yet multiplied: decode attention folds the scales into its scores and
        probabilities (``block_size`` products per tile instead of ``block_size * head_dim``)."""
        raw = self.tiles.index_select(0, rows)
        values = self.codec.decode_codes(raw[:, :self.codes_bytes], self.dtype)
        return values, raw[:, self.codes_bytes:].view(SCALE_DTYPE).to(self.dtype).contiguous()


def make_pool_view(pool: torch.Tensor, block_size: int, head_dim: int, spec: KVCacheSpec,
                   codec: KVCodec | None) -> PlainPoolView | QuantPoolView:
    if spec.quantized:
        assert codec is not None
        return QuantPoolView(pool, block_size, head_dim, spec, codec)
    return PlainPoolView(pool, block_size, head_dim)

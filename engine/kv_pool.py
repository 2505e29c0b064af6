"""The paged KV pool: one tensor per worker, block-major.

Layout ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``:
one block is one contiguous region across all layers, so a transfer needs one
descriptor per run of consecutive blocks. The order inside a block belongs to
the attention backend. A quantized pool (``kv_cache_dtype`` int8 / fp8_e4m3,
:mod:`engine.kv_quant`) is ``uint8`` ``[num_blocks, num_layers, 2,
num_kv_heads, block_size * (head_dim + 2)]``: each tile holds its codes and
then its per-token scales, so the scales travel inside the block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import huge_pages
from engine.config import CacheConfig, ModelConfig
from engine.kv_quant import KVCacheSpec


@dataclass(frozen=True)
class KVPoolCapacity:
    kv_bytes_per_token: int
    bytes_per_block: int
    block_size: int
    num_blocks: int
    max_model_len: int
    kv_cache_dtype: str = "auto"

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def blocks_per_full_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_full_length_seqs(self) -> int:
        """Sequences of ``max_model_len`` tokens that fit at once."""
        return self.num_blocks // self.blocks_per_full_seq

    def describe(self) -> str:
        return (f"KV pool: {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_tokens} tokens, {self.total_bytes / 2**20:.1f} MiB "
                f"({self.kv_bytes_per_token} B/token, {self.bytes_per_block / 1024:.1f} KiB/block, "
                f"kv_cache_dtype={self.kv_cache_dtype}); "
                f"{self.max_full_length_seqs} sequences of max_model_len={self.max_model_len} fit")


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block at model dtype ``dtype`` stored as ``kv_cache_dtype`` (scales included)."""
    spec = KVCacheSpec(kv_cache_dtype, dtype)
    return spec.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim) * block_size


def plan_num_blocks(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                    max_model_len: int) -> int:
    """Explicit ``num_blocks`` wins; otherwise as many blocks as the budget holds.
    Raises ValueError when not even one sequence of ``max_model_len`` fits."""
    per_block = bytes_per_block(model, cache.block_size, dtype, cache.kv_cache_dtype)
    if cache.num_blocks is not None:
        num = cache.num_blocks
    else:
        num = cache.kv_cache_memory_bytes // per_block
        if num < 1:
            raise ValueError(f"kv_cache_memory ({cache.kv_cache_memory_bytes} B) is smaller than one "
                             f"KV block ({per_block} B): raise it")
    need = -(-max_model_len // cache.block_size)
    if num < need:
        raise ValueError(f"the KV pool holds {num} blocks ({num * cache.block_size} tokens) but one "
                         f"sequence of max_model_len={max_model_len} needs {need}: raise "
                         "kv_cache_memory / num_blocks or lower max_model_len")
    return num


class KVPool:
    """Owns the pool tensor. kvtransfer registers ``tensor`` block by block
    (``bytes_per_block`` each, block ``i`` at byte offset ``i * bytes_per_block``)."""

    def __init__(self, model: ModelConfig, *, num_blocks: int, block_size: int,
                 device: torch.device | str, dtype: torch.dtype, max_model_len: int | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.model_config = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.spec = KVCacheSpec(kv_cache_dtype, dtype)
        self.dtype = self.spec.storage_dtype       # the tensor's dtype (uint8 when quantized)
        self.bytes_per_block = bytes_per_block(model, block_size, dtype, kv_cache_dtype)
        # zeros, not empty: masked-out (padding) keys/values must be finite
        self.tensor = huge_pages.zeros(self.block_shape(num_blocks), device=device, dtype=self.dtype)
        self.capacity = KVPoolCapacity(
            kv_bytes_per_token=self.bytes_per_block // block_size, bytes_per_block=self.bytes_per_block,
            block_size=block_size, num_blocks=num_blocks,
            max_model_len=max_model_len or model.max_position_embeddings, kv_cache_dtype=kv_cache_dtype)

    @classmethod
    def from_cache_config(cls, model: ModelConfig, cache: CacheConfig, *, device: torch.device | str,
                          dtype: torch.dtype, max_model_len: int) -> "KVPool":
        num = plan_num_blocks(model, cache, dtype, max_model_len)
        return cls(model, num_blocks=num, block_size=cache.block_size, device=device, dtype=dtype,
                   max_model_len=max_model_len, kv_cache_dtype=cache.kv_cache_dtype)

    @property
    def kv_cache_dtype(self) -> str:
        return self.spec.name

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        m = self.model_config
        if self.spec.quantized:
            return (num_blocks, m.num_layers, 2, m.num_kv_heads, self.spec.tile_bytes(self.block_size, m.head_dim))
        return (num_blocks, m.num_layers, 2, m.num_kv_heads, self.block_size, m.head_dim)

    def describe(self) -> str:
        return self.capacity.describe()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: ``pool[dst] = pool[src]`` for each (src, dst), all layers at once."""
        if not pairs:
            return
        src_ids = [s for s, _ in pairs]
        dst_ids = [d for _, d in pairs]
        if not all(0 <= b < self.num_blocks for b in src_ids + dst_ids):
            raise ValueError(f"block copies {pairs} refer to a block outside [0, {self.num_blocks})")
        if len(set(dst_ids)) != len(dst_ids):
            raise ValueError(f"block copies {pairs} write one destination block twice")
        dev = self.tensor.device
        src = torch.tensor(src_ids, dtype=torch.int64, device=dev)
        dst = torch.tensor(dst_ids, dtype=torch.int64, device=dev)
        self.tensor.index_copy_(0, dst, self.tensor.index_select(0, src))

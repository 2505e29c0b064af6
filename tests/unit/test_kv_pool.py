"""KV pool sizing, layout and copy-on-write."""
from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, ModelConfig
from engine.kv_pool import KVPool, plan_num_blocks

SMOL = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                   num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                   max_position_embeddings=8192, tie_word_embeddings=True)
TINY = ModelConfig(architecture="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                   num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64)


def test_capacity_from_memory_budget():
    per_block = 2 * 30 * 3 * 64 * 4 * 16                    # 737,280 B in fp32
    cache = CacheConfig(block_size=16, kv_cache_memory_bytes=100 * per_block + 5)
    assert plan_num_blocks(SMOL, cache, torch.float32, max_model_len=1024) == 100
    assert plan_num_blocks(SMOL, cache, torch.bfloat16, max_model_len=1024) == 200
    pool = KVPool(TINY, num_blocks=10, block_size=4, device="cpu", dtype=torch.float32, max_model_len=16)
    cap = pool.capacity
    assert (cap.kv_bytes_per_token, cap.bytes_per_block, cap.num_tokens) == (2 * 2 * 8 * 4, 512, 40)
    assert cap.max_full_length_seqs == 2                    # 4 blocks per 16-token sequence
    assert "10 blocks" in pool.describe() and "2 sequences of max_model_len=16" in pool.describe()


def test_explicit_num_blocks_wins_and_layout_is_block_major():
    cache = CacheConfig(block_size=4, num_blocks=7, kv_cache_memory_bytes=1)
    pool = KVPool.from_cache_config(TINY, cache, device="cpu", dtype=torch.float32, max_model_len=16)
    assert pool.num_blocks == 7
    assert pool.tensor.shape == (7, 2, 2, 1, 4, 8)          # [blocks, layers, k|v, kv_heads, block, dim]
    assert pool.tensor.is_contiguous() and pool.bytes_per_block == pool.tensor[0].numel() * 4
    assert torch.count_nonzero(pool.tensor) == 0            # zeroed: padding keys stay finite


@pytest.mark.parametrize("cache,max_len,match", [
    (CacheConfig(block_size=16, kv_cache_memory_bytes=1000), 64, "smaller than one KV block"),
    (CacheConfig(block_size=16, num_blocks=3), 64, "lower max_model_len"),
])
def test_too_small_pool_is_a_clear_error(cache, max_len, match):
    with pytest.raises(ValueError, match=match):
        plan_num_blocks(SMOL, cache, torch.float32, max_model_len=max_len)


def test_copy_blocks_copies_every_layer():
    pool = KVPool(TINY, num_blocks=6, block_size=4, device="cpu", dtype=torch.float32)
    pool.tensor.copy_(torch.randn(pool.tensor.shape))
    before = pool.tensor.clone()
    pool.copy_blocks([(1, 4), (2, 5)])
    assert torch.equal(pool.tensor[4], before[1]) and torch.equal(pool.tensor[5], before[2])
    assert torch.equal(pool.tensor[:4], before[:4])
    with pytest.raises(ValueError, match="outside"):
        pool.copy_blocks([(1, 6)])
    with pytest.raises(ValueError, match="twice"):
        pool.copy_blocks([(1, 3), (2, 3)])

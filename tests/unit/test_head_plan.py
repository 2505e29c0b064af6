"""Cross-TP hand-off plans: every decode rank's pool ends up holding exactly its KV heads,
read from the prefill ranks' own pools by the planned descriptors (executed as memcpy)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from kvtransfer.head_plan import BlockShape, HeadShard, head_shards, plan_segments, segment_descriptors
from kvtransfer.layout import KVPoolLayout

LAYERS, BLOCK, HEAD_DIM, BLOCKS = 3, 4, 8, 10


def _rank_pools(full: torch.Tensor, shards: list[HeadShard]) -> list[torch.Tensor]:
    return [full[:, :, :, s.first_head:s.end].contiguous() for s in shards]


def _run(descs) -> None:
    for d in descs:
        ctypes.memmove(d.dst_addr, d.src_addr, d.nbytes)


def _hand_off(num_kv_heads: int, p_tp: int, d_tp: int, src_ids, dst_ids):
    full = torch.randn(BLOCKS, LAYERS, 2, num_kv_heads, BLOCK * HEAD_DIM)
    p_shards, d_shards = head_shards(num_kv_heads, p_tp), head_shards(num_kv_heads, d_tp)
    p_pools = _rank_pools(full, p_shards)
    d_pools = [torch.zeros(BLOCKS, LAYERS, 2, s.num_heads, BLOCK * HEAD_DIM) for s in d_shards]
    shape = BlockShape(LAYERS, BLOCK * HEAD_DIM * 4)
    counts = []
    for d_rank, (d_shard, d_pool) in enumerate(zip(d_shards, d_pools)):
        segs = plan_segments(p_shards, d_shard, d_rank, shape)
        covered = sorted((s.dst_offset, s.dst_offset + s.nbytes) for s in segs)
        assert covered[0][0] == 0 and covered[-1][1] == shape.block_bytes(d_shard)
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))      # each byte once
        n = 0
        for p_rank in sorted({s.src_rank for s in segs}):
            descs = segment_descriptors(KVPoolLayout.from_tensor(p_pools[p_rank]), KVPoolLayout.from_tensor(d_pool),
                                        src_ids, dst_ids, [s for s in segs if s.src_rank == p_rank])
            _run(descs)
            n += len(descs)
        counts.append(n)
    for d_shard, d_pool in zip(d_shards, d_pools):
        want = full[:, :, :, d_shard.first_head:d_shard.end]
        assert torch.equal(d_pool[list(dst_ids)], want[list(src_ids)])
        untouched = [b for b in range(BLOCKS) if b not in dst_ids]
        assert not d_pool[untouched].any()
    return counts


@pytest.mark.parametrize("heads,p_tp,d_tp", [(2, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2), (4, 4, 2),
                                             (4, 2, 4), (1, 2, 1), (1, 1, 2), (2, 4, 1), (2, 1, 4), (2, 4, 2)])
def test_every_decode_rank_gets_exactly_its_heads(heads, p_tp, d_tp):
    _hand_off(heads, p_tp, d_tp, src_ids=[7, 8, 9, 2], dst_ids=[0, 1, 2, 5])


def test_matching_splits_move_whole_blocks_in_runs():
    # TP 2 -> 2: rank r reads its block from rank r, one descriptor per run of consecutive blocks
    assert _hand_off(2, 2, 2, src_ids=[7, 8, 9, 2], dst_ids=[0, 1, 2, 5]) == [2, 2]
    # TP 2 -> 1: the decode block interleaves both prefill ranks' heads per (layer, K|V)
    assert _hand_off(2, 2, 1, src_ids=[7, 8, 9, 2], dst_ids=[0, 1, 2, 5]) == [4 * 2 * LAYERS * 2]


def test_replicas_are_read_from_different_prefill_ranks():
    # 1 KV head replicated on 2 prefill ranks; 2 decode ranks read from different replicas
    p = head_shards(1, 2)
    shape = BlockShape(LAYERS, 64)
    assert {plan_segments(p, HeadShard(0, 1), r, shape)[0].src_rank for r in (0, 1)} == {0, 1}


def test_tp_sizes_that_split_neither_way_are_refused():
    with pytest.raises(ValueError, match="divisor or a multiple of 3"):
        head_shards(3, 2)
    assert [(s.first_head, s.num_heads) for s in head_shards(2, 4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]


def test_a_segment_past_the_block_is_refused():
    a = torch.zeros(4, 16)
    lay = KVPoolLayout.from_tensor(a)
    from kvtransfer.head_plan import Segment
    with pytest.raises(ValueError, match="reaches past a block"):
        segment_descriptors(lay, lay, [0], [1], [Segment(0, 32, 0, 64)])


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_head_shards_agree_with_the_engines_split(kv_heads, tp):
    """kvtransfer and engine may not import each other, so the KV-head rule is stated in both:
    head_shards (what a hand-off reads) must equal ShardLayout (what each rank's pool holds)."""
    from engine.config import ModelConfig
    from engine.parallel.sharding import ShardLayout
    model = ModelConfig(architecture="llama", vocab_size=64, hidden_size=128, intermediate_size=64,
                        num_layers=1, num_heads=8, num_kv_heads=kv_heads, head_dim=16)
    engine_side = [ShardLayout.of(model, tp, r) for r in range(tp)]
    assert [(s.first_head, s.num_heads) for s in head_shards(kv_heads, tp)] == \
        [(e.kv_head_start, e.num_kv_heads) for e in engine_side]

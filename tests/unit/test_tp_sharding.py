"""Tensor-parallel sharding rules (engine/parallel/sharding.py): which sizes split a model, which
heads each rank holds (split, then replicated), and that the ranks' slices rebuild the model."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.parallel.sharding import (ShardLayout, check_tp_size, kv_heads_per_rank, kv_replication,
                                      shard_state_dict, valid_tp_sizes)


def _cfg(heads=4, kv=2, inter=128, vocab=101, hidden=64, layers=2, **kw) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads,
                       name="tiny", **kw)


@pytest.mark.parametrize("heads,kv,inter,sizes", [
    (4, 2, 128, [1, 2, 4]),
    (32, 8, 14336, [1, 2, 4, 8, 16, 32]),      # Llama-3-8B's shape
    (9, 3, 1536, [1, 3]),                      # SmolLM2-135M: 9 does not divide the FFN
    (12, 12, 48, [1, 2, 3, 4, 6, 12]),
    (8, 1, 64, [1, 2, 4, 8]),
])
def test_valid_sizes_divide_heads_and_ffn_and_split_or_replicate_kv(heads, kv, inter, sizes):
    assert valid_tp_sizes(_cfg(heads, kv, inter)) == sizes


def test_a_size_that_divides_neither_way_names_the_sizes_that_work():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*Use one of: 1, 2, 4$"):
        check_tp_size(_cfg(heads=4, kv=2), 3)
    with pytest.raises(ValueError, match="either divide the KV heads or be a multiple of them"):
        check_tp_size(_cfg(heads=12, kv=3, inter=48), 2)     # 2 ∤ 3 and 3 ∤ 2
    check_tp_size(_cfg(heads=12, kv=3, inter=48), 6)         # 3 | 6: each KV head on 2 ranks


def test_engine_config_refuses_a_size_below_one():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(model="m", tensor_parallel_size=0)


@pytest.mark.parametrize("kv,tp,per_rank,copies", [(8, 1, 8, 1), (8, 2, 4, 1), (8, 8, 1, 1), (8, 16, 1, 2),
                                                   (2, 4, 1, 2), (1, 2, 1, 2)])
def test_kv_heads_split_then_replicate(kv, tp, per_rank, copies):
    assert (kv_heads_per_rank(kv, tp), kv_replication(kv, tp)) == (per_rank, copies)


def test_replicated_kv_head_is_the_one_the_ranks_query_heads_read():
    cfg = _cfg(heads=8, kv=2, inter=64)
    layouts = [ShardLayout.of(cfg, 4, r) for r in range(4)]
    assert [(lay.head_start, lay.num_heads) for lay in layouts] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(lay.kv_head_start, lay.num_kv_heads) for lay in layouts] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    group = cfg.num_heads // cfg.num_kv_heads
    for lay in layouts:          # every query head of the rank belongs to the rank's KV head
        assert {h // group for h in range(lay.head_start, lay.head_start + lay.num_heads)} == {lay.kv_head_start}


def test_local_config_is_the_ranks_shard():
    local = ShardLayout.of(_cfg(vocab=101), 2, 1).local_config(_cfg(vocab=101))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 64, 51)
    assert local.kv_bytes_per_token(4) == _cfg().kv_bytes_per_token(4) // 2


def _state(cfg: ModelConfig, bias: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hd, h, kv = cfg.head_dim, cfg.hidden_size, cfg.num_kv_heads

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    sd = {"model.embed_tokens.weight": r(cfg.vocab_size, h), "lm_head.weight": r(cfg.vocab_size, h),
          "model.norm.weight": r(h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd |= {p + "self_attn.q_proj.weight": r(cfg.num_heads * hd, h), p + "self_attn.k_proj.weight": r(kv * hd, h),
               p + "self_attn.v_proj.weight": r(kv * hd, h), p + "self_attn.o_proj.weight": r(h, cfg.num_heads * hd),
               p + "mlp.gate_proj.weight": r(cfg.intermediate_size, h),
               p + "mlp.up_proj.weight": r(cfg.intermediate_size, h),
               p + "mlp.down_proj.weight": r(h, cfg.intermediate_size), p + "input_layernorm.weight": r(h)}
        if bias:
            sd |= {p + f"self_attn.{x}_proj.bias": r(n * hd) for x, n in (("q", cfg.num_heads), ("k", kv), ("v", kv))}
    return sd


@pytest.mark.parametrize("kv,tp", [(2, 2), (4, 2), (1, 2), (2, 4)])
def test_rank_slices_rebuild_the_model(kv, tp):
    cfg = _cfg(heads=4, kv=kv, vocab=101)
    sd = _state(cfg, bias=True)
    shards = [shard_state_dict(sd, cfg, ShardLayout.of(cfg, tp, r)) for r in range(tp)]
    p = "model.layers.1."
    for name, dim in (("self_attn.q_proj.weight", 0), ("self_attn.q_proj.bias", 0), ("self_attn.o_proj.weight", 1),
                      ("mlp.gate_proj.weight", 0), ("mlp.up_proj.weight", 0), ("mlp.down_proj.weight", 1)):
        assert torch.equal(torch.cat([s[p + name] for s in shards], dim), sd[p + name]), name
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        full = torch.cat([s[name] for s in shards])
        assert torch.equal(full[:101], sd[name]) and not full[101:].any()      # zero padding
    k = [s[p + "self_attn.k_proj.weight"] for s in shards]
    if kv >= tp:
        assert torch.equal(torch.cat(k), sd[p + "self_attn.k_proj.weight"])
    else:                                                   # replicated: each rank its group's head
        copies = tp // kv
        for r, part in enumerate(k):
            head = r // copies
            assert torch.equal(part, sd[p + "self_attn.k_proj.weight"][head * 16:(head + 1) * 16])
    assert all(s["model.norm.weight"] is sd["model.norm.weight"] for s in shards)


def test_a_bias_after_a_row_parallel_projection_is_refused():
    cfg = _cfg()
    sd = _state(cfg, bias=False) | {"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        shard_state_dict(sd, cfg, ShardLayout.of(cfg, 2, 0))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_reads_the_same_slices_lazily_from_safetensors(tiny_qwen2_dir, rank):
    from engine.loader import load_hf_config, load_hf_weights
    from engine.parallel.shard_loader import load_rank_weights

    cfg, layout, lazy = load_rank_weights(tiny_qwen2_dir, 2, rank)
    assert cfg == load_hf_config(tiny_qwen2_dir) and layout == ShardLayout.of(cfg, 2, rank)
    eager = shard_state_dict(load_hf_weights(tiny_qwen2_dir), cfg, layout)
    assert lazy.keys() == eager.keys()
    assert all(torch.equal(lazy[k], eager[k]) for k in eager)

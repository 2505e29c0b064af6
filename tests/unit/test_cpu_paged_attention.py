"""cpu_paged (C++ kernel over the pool) against torch_paged on random pools.

The kernel is built once per machine into the kernel cache (engine/attention/kernels.py):
the first test pays the build, every other test and process loads it."""
from __future__ import annotations

import random

import pytest
import torch

from engine.attention import AttentionShape, get_attention_backend
from engine.attention.backend import resolve_backend_name
from engine.attention.kernels import cpu_kernel_available
from engine.batch import AttentionMetadata

needs_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason="the cpu_paged kernel did not build here")

LAYERS = 3


def _metadata(seqs: list[tuple[int, int]], block_size: int, num_blocks: int, rng: random.Random):
    """seqs: (query_len, context_len) per sequence, prefill-like first -> metadata."""
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables, slots, qsl = [], [], [0]
    for ql, ctx in seqs:
        nb = -(-ctx // block_size)
        blocks, ids = ids[:nb], ids[nb:]
        tables.append(blocks)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(ctx - ql, ctx))
        qsl.append(qsl[-1] + ql)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    n_pre = sum(1 for ql, _ in seqs if ql > 1)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_lens=torch.tensor([q for q, _ in seqs]),
        context_lens=torch.tensor([c for _, c in seqs]), query_start_loc=torch.tensor(qsl),
        block_tables=bt, num_prefills=n_pre, num_prefill_tokens=qsl[n_pre],
        max_query_len=max(q for q, _ in seqs), max_context_len=max(c for _, c in seqs),
        block_size=block_size)


def _kernel_backend(shape, kv_spec=None, prefill_in_kernel=True):
    """cpu_paged, its prefill in the kernel unless told otherwise."""
    from engine.attention.cpu_paged import CpuPagedAttention

    return CpuPagedAttention(shape, kv_spec, prefill_in_kernel=prefill_in_kernel)


def _compare(seqs, *, block_size=16, kv_heads=3, group=3, head_dim=64, dtype=torch.float32, seed=0,
             prefill_in_kernel=True):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    shape = AttentionShape(LAYERS, kv_heads * group, kv_heads, head_dim, block_size)
    num_blocks = sum(-(-c // block_size) for _, c in seqs) + 4
    pool = torch.randn(num_blocks, LAYERS, 2, kv_heads, block_size, head_dim, generator=g).to(dtype)
    meta = _metadata(seqs, block_size, num_blocks, rng)
    t = int(meta.query_start_loc[-1])
    outs = []
    for backend in (get_attention_backend("torch_paged", shape), _kernel_backend(shape, None, prefill_in_kernel)):
        p = pool.clone()
        plan = backend.plan(meta, p)
        per_layer = []
        for layer in range(LAYERS):
            lg = torch.Generator().manual_seed(seed * 100 + layer)
            q = torch.randn(t, shape.num_heads, head_dim, generator=lg).to(dtype)
            k = torch.randn(t, kv_heads, head_dim, generator=lg).to(dtype)
            v = torch.randn(t, kv_heads, head_dim, generator=lg).to(dtype)
            per_layer.append(backend.forward(plan, layer, q, k, v))
        outs.append((torch.stack(per_layer), p))
    (ref, ref_pool), (got, got_pool) = outs
    assert torch.equal(ref_pool, got_pool), "the two backends wrote different K/V"
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_decode_batch_matches_torch_paged(block_size, group, head_dim):
    _compare([(1, 37), (1, 1), (1, 200), (1, 64), (1, 513)], block_size=block_size, group=group,
             head_dim=head_dim, kv_heads=2)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx", [5, 300, 1000])
def test_batch_one_decode_split_context_matches(dtype, ctx):
    _compare([(1, ctx)], dtype=dtype, seed=ctx)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_mixed_prefill_with_prefixes_and_decodes(dtype, group):
    # fresh prompts, prompts after a cached prefix (not block-aligned), decodes
    _compare([(7, 7), (40, 95), (33, 33), (1, 1), (1, 50), (1, 129)], dtype=dtype, group=group, kv_heads=2)
    _compare([(70, 70), (5, 30), (1, 17)], dtype=dtype, group=group, kv_heads=2, head_dim=16, block_size=32)


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_single_prompt_paths(block_size, head_dim):
    _compare([(77, 77)], block_size=block_size, head_dim=head_dim)          # fresh: SDPA on new K/V
    _compare([(77, 77), (1, 20)], block_size=block_size, head_dim=head_dim)  # fresh + decodes
    _compare([(50, 171)], block_size=block_size, head_dim=head_dim)          # chunk after a prefix


@needs_kernel
def test_auto_picks_cpu_paged_where_the_kernel_builds():
    from engine.attention import backend

    backend._auto_backend.cache_clear()
    try:
        assert resolve_backend_name("auto") == "cpu_paged"
        assert resolve_backend_name("torch_paged") == "torch_paged"
    finally:
        backend._auto_backend.cache_clear()


@needs_kernel
@pytest.mark.parametrize("in_kernel", [True, False])
def test_prefill_steps_run_in_the_kernel_unless_told_otherwise(in_kernel):
    """By default every step runs in the kernel, on 16- and 8-float vectors alike; with
    ``prefill_in_kernel=False`` (the AVX2 rule while the kernel's prefill was the slower) a step
    with a prefill-like sequence is planned by torch_paged and a decode-only step by the kernel.
    Either way the outputs match torch_paged."""
    from engine.attention import cpu_paged
    from engine.attention.torch_paged import TorchPagedPlan

    shape = AttentionShape(LAYERS, 9, 3, 64, 16)
    assert get_attention_backend("cpu_paged", shape).prefill_in_kernel is True
    backend = cpu_paged.CpuPagedAttention(shape, prefill_in_kernel=in_kernel)
    pool = torch.zeros(16, LAYERS, 2, 3, 16, 64)
    rng = random.Random(0)
    mixed = backend.plan(_metadata([(20, 20), (1, 40)], 16, 16, rng), pool)
    decodes = backend.plan(_metadata([(1, 30), (1, 40)], 16, 16, rng), pool)
    assert isinstance(mixed, TorchPagedPlan) is not in_kernel
    assert isinstance(decodes, cpu_paged.CpuPagedPlan)
    _compare([(77, 77), (1, 20)], prefill_in_kernel=in_kernel)
    _compare([(1, 300), (1, 20)], prefill_in_kernel=in_kernel)


@needs_kernel
def test_quantized_pool_falls_back_to_torch_paged():
    from engine.attention.torch_paged import TorchPagedPlan
    from engine.kv_quant import KVCacheSpec

    spec = KVCacheSpec("int8", torch.float32)
    backend = get_attention_backend("cpu_paged", AttentionShape(1, 3, 1, 64, 16), spec)
    pool = torch.zeros(4, 1, 2, 1, spec.tile_bytes(16, 64), dtype=torch.uint8)
    meta = _metadata([(1, 3)], 16, 4, random.Random(0))
    assert isinstance(backend.plan(meta, pool), TorchPagedPlan)


def test_auto_falls_back_to_torch_paged_with_one_log_line(monkeypatch, caplog):
    from engine.attention import backend, kernels

    monkeypatch.setattr(kernels, "load_cpu_kernel", lambda: "CalledProcessError: no g++")
    backend._auto_backend.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="engine.attention.backend"):
            assert resolve_backend_name("auto") == "torch_paged"
            assert resolve_backend_name("auto") == "torch_paged"
        assert [r.getMessage() for r in caplog.records] == [
            "attention: the cpu_paged kernel did not build (CalledProcessError: no g++); falling back to torch_paged"]
    finally:
        backend._auto_backend.cache_clear()


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="auto, torch_paged, cpu_paged"):
        get_attention_backend("flash", AttentionShape(1, 3, 1, 64, 16))


@needs_kernel
@pytest.mark.parametrize("seqs", [[(77, 77), (1, 20), (1, 300)], [(40, 95), (9, 9), (1, 1), (1, 129)],
                                  [(1, 33)] * 5])
def test_forward_qkv_rotates_and_writes_like_torch(seqs):
    # cpu_paged's fused op (float32: RoPE in place in qkv + the K/V write) against the torch
    # path: the same pool bytes, the same rotated q, the same attention (other dtypes take
    # the torch path in both backends)
    dtype = torch.float32
    from engine.attention.rotary import apply_rotary
    from engine.model.rope import RotaryEmbedding

    kv_heads, group, head_dim, bs = 3, 3, 64, 16
    shape = AttentionShape(LAYERS, kv_heads * group, kv_heads, head_dim, bs)
    num_blocks = sum(-(-c // bs) for _, c in seqs) + 4
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(num_blocks, LAYERS, 2, kv_heads, bs, head_dim, generator=g).to(dtype)
    meta = _metadata(seqs, bs, num_blocks, random.Random(1))
    t = int(meta.query_start_loc[-1])
    positions = torch.cat([torch.arange(c - q, c) for q, c in seqs])
    rope = RotaryEmbedding(head_dim, 2048, 10000.0, None, device="cpu", dtype=dtype).tables(positions)
    width = (shape.num_heads + 2 * kv_heads) * head_dim
    outs = []
    for name in ("torch_paged", "cpu_paged"):
        backend = get_attention_backend(name, shape) if name == "torch_paged" else _kernel_backend(shape)
        p = pool.clone()
        plan = backend.plan(meta, p)
        per_layer, rotated = [], []
        for layer in range(LAYERS):
            qkv = torch.randn(t, width, generator=torch.Generator().manual_seed(layer)).to(dtype)
            want_q = apply_rotary(qkv[:, :shape.num_heads * head_dim].view(t, -1, head_dim), *rope)
            per_layer.append(backend.forward_qkv(plan, layer, qkv, rope))
            rotated.append(want_q if name == "torch_paged" else qkv[:, :shape.num_heads * head_dim].view(t, -1, head_dim))
        outs.append((torch.stack(per_layer), p, torch.stack(rotated)))
    (ref, ref_pool, ref_q), (got, got_pool, got_q) = outs
    assert torch.equal(ref_pool, got_pool), "the fused op wrote other K/V than the torch path"
    assert torch.equal(ref_q, got_q), "the fused op rotated q differently from apply_rotary"
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)

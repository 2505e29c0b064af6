"""Quantized KV cache: codecs, the in-block layout, and the pool's bytes against
transformers' own K/V (layer 0, whose K/V do not depend on earlier quantization)."""
from __future__ import annotations

import pytest
import torch

from _runner_helpers import request, sched_seq, step
from engine import kv_fp8
from engine.config import CacheConfig, ModelConfig
from engine.kv_pool import KVPool, bytes_per_block, plan_num_blocks
from engine.kv_quant import SCALE_DTYPE, KVCacheSpec, KVCodec
from engine.loader import load_model_source
from engine.model_runner import ModelRunner
from tiny_models import load_hf_model

SMOL = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                   num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)


def test_fp8_fallback_codec_matches_torch_bit_for_bit():
    table = kv_fp8.decode_table()
    native = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(table.nan_to_num(7.0), native.nan_to_num(7.0))
    pos = table[:127]
    ties = (pos[1:] + pos[:-1]) / 2                        # exact halfway points: ties to even
    y = torch.cat([torch.randn(20000) * 100, torch.randn(20000) * 0.01, ties, -ties,
                   torch.tensor([0.0, -0.0, 448.0, -448.0])]).clamp(-448, 448)
    assert torch.equal(kv_fp8.encode(y), y.to(torch.float8_e4m3fn).view(torch.uint8))
    assert kv_fp8.native_cast_supported(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_decode_by_moved_bits_matches_torch_cast_exactly(dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    finite = (codes & 0x7F) != 0x7F                          # the quantizer never writes the NaN codes
    native = codes.view(torch.float8_e4m3fn).to(dtype)
    moved = kv_fp8.decode_via_half(codes, dtype)
    assert moved.dtype == dtype
    assert torch.equal(moved[finite], native[finite])
    assert torch.equal(torch.signbit(moved[finite]), torch.signbit(native[finite]))   # -0.0 stays -0.0
    codec = KVCodec(KVCacheSpec("fp8_e4m3"), "cpu")
    assert not codec.native_fp8_decode                       # the CPU decodes by moved bits
    tile = codes[finite].view(1, -1).expand(3, -1)           # non-contiguous rows, as a gather slices them
    assert torch.equal(codec.decode_codes(tile, dtype), native[finite].expand(3, -1))


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_codec_error_is_bounded_by_the_per_token_scale(name):
    codec = KVCodec(KVCacheSpec(name), "cpu")
    x = torch.randn(64, 3, 64) * torch.logspace(-3, 2, 64).view(64, 1, 1)   # tokens of very different sizes
    x[5, 1] = 0.0                                           # a zero vector stays exactly zero
    codes, scale = codec.quantize(x)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and scale.dtype == SCALE_DTYPE
    back = codec.dequantize(codes, scale, torch.float32)
    err = (back - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    if name == "int8":
        assert torch.all(err <= amax / 127 * 0.5 * 1.01 + 1e-30)      # half a step of the token's own scale
    else:                                                   # 3 mantissa bits: half an ulp, or the subnormal step
        assert torch.all(err <= torch.maximum(x.abs() / 16, amax / 448 * 2.0 ** -10) * 1.01 + 1e-30)
    assert torch.equal(back[5, 1], torch.zeros(64))
    assert err.max() > 0                                    # it does quantize


def test_bytes_per_token_include_the_scales_and_match_the_pool():
    # SmolLM2: 2 x 30 layers x 3 heads x (64 codes + 2 scale bytes) = 11,880 B/token
    assert KVCacheSpec("int8", torch.bfloat16).bytes_per_token(30, 3, 64) == 11880
    assert KVCacheSpec("fp8_e4m3", torch.float32).bytes_per_token(30, 3, 64) == 11880
    assert KVCacheSpec("auto", torch.bfloat16).bytes_per_token(30, 3, 64) == 23040
    assert bytes_per_block(SMOL, 16, torch.bfloat16, "int8") == 11880 * 16
    bf16 = plan_num_blocks(SMOL, CacheConfig(kv_cache_memory_bytes=1 << 30), torch.bfloat16, 1024)
    fp32 = plan_num_blocks(SMOL, CacheConfig(kv_cache_memory_bytes=1 << 30), torch.float32, 1024)
    int8 = plan_num_blocks(SMOL, CacheConfig(kv_cache_memory_bytes=1 << 30, kv_cache_dtype="int8"),
                           torch.bfloat16, 1024)
    assert int8 >= 1.9 * bf16 and int8 >= 3.7 * fp32
    pool = KVPool(SMOL, num_blocks=3, block_size=16, device="cpu", dtype=torch.float32, kv_cache_dtype="fp8_e4m3")
    assert pool.tensor.dtype == torch.uint8 and pool.tensor.is_contiguous()
    assert pool.tensor.shape == (3, 30, 2, 3, 16 * 66)
    assert pool.tensor[0].numel() == pool.bytes_per_block == pool.capacity.kv_bytes_per_token * 16
    assert "kv_cache_dtype=fp8_e4m3" in pool.describe()
    with pytest.raises(ValueError, match="auto, int8 or fp8_e4m3"):
        CacheConfig(kv_cache_dtype="int4")


def _decode_block_tile(pool: KVPool, block: int, layer: int, kv: int) -> torch.Tensor:
    """Decode one tile by the documented layout: block_size*head_dim codes, then block_size bf16 scales."""
    bs, d = pool.block_size, pool.model_config.head_dim
    tile = pool.tensor[block, layer, kv]                    # [kv_heads, bs*(d+2)] bytes
    codes = tile[:, :bs * d].reshape(-1, bs, d)
    scales = tile[:, bs * d:].contiguous().view(SCALE_DTYPE).float()       # [kv_heads, bs]
    if pool.kv_cache_dtype == "int8":
        values = codes.view(torch.int8).float()
    else:
        values = kv_fp8.decode_table()[codes.long()]
    return values * scales.unsqueeze(-1)


@pytest.mark.parametrize("name,tol", [("int8", 1 / 127 * 0.51), ("fp8_e4m3", 1 / 16 * 1.01)])
def test_pool_bytes_decode_to_transformers_kv(tiny_llama_dir, name, tol):
    cfg, sd = load_model_source(tiny_llama_dir)
    runner = ModelRunner(cfg, sd, cache_config=CacheConfig(block_size=4, num_blocks=16, kv_cache_dtype=name),
                         max_model_len=64)
    prompt = [7, 99, 23, 150, 42, 8, 61, 77, 5, 12]
    blocks = [3, 9, 4]                                      # scattered on purpose
    step(runner, [sched_seq(request("p", prompt), len(prompt), blocks)])
    hf = load_hf_model(tiny_llama_dir)
    with torch.no_grad():
        cache = hf(torch.tensor([prompt]), use_cache=True).past_key_values
    ref_k, ref_v = cache.layers[0].keys[0], cache.layers[0].values[0]      # [kv_heads, T, D], K after RoPE
    for kv, ref in ((0, ref_k), (1, ref_v)):
        got = torch.cat([_decode_block_tile(runner.kv_pool, b, 0, kv) for b in blocks], dim=1)[:, :len(prompt)]
        amax = ref.abs().amax(-1, keepdim=True)
        err = (got - ref).abs()
        # int8: half a step of each token's scale; fp8: relative to the value (or its scale's subnormal step)
        bound = amax * tol if name == "int8" else torch.maximum(ref.abs() * tol, amax / 448 * 2.0 ** -9)
        assert torch.all(err <= bound + 1e-6), float((err - bound).max())
        assert err.max() > 1e-4                             # quantized, not stored as is
    untouched = [b for b in range(16) if b not in blocks]
    assert torch.count_nonzero(runner.kv_pool.tensor[untouched]) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_decode_steps_read_what_a_whole_prefill_attends_to(tiny_llama_dir, name, dtype):
    """Decode folds the per-token scales into scores and probabilities; a single prefill attends over
    the quantize-dequantize round trip: both read the same values, so the last token's logits agree."""
    cfg, sd = load_model_source(tiny_llama_dir)
    prompt, extra = [7, 99, 23, 150, 42, 8, 61, 77, 5], [11, 12, 13]
    cache = CacheConfig(block_size=4, num_blocks=16, kv_cache_dtype=name)
    stepped = ModelRunner(cfg, sd, cache_config=cache, max_model_len=64, dtype=dtype)
    req = request("p", prompt)
    step(stepped, [sched_seq(req, len(prompt), [3, 4, 5])])
    for tok in extra:
        req.append_output_token(tok)
        logits = step(stepped, [sched_seq(req, 1, [3, 4, 5, 6])])
    whole = ModelRunner(cfg, sd, cache_config=cache, max_model_len=64, dtype=dtype)
    ref = step(whole, [sched_seq(request("w", prompt + extra), len(prompt) + 3, [8, 1, 2])])
    assert logits.dtype == torch.float32
    assert int(logits[0].argmax()) == int(ref[0].argmax())
    tol = 1e-3 if dtype == "float32" else 0.05
    assert (logits[0] - ref[0]).abs().max() < tol * ref[0].abs().max()

"""Quantized KV cache: the storage format of one KV block, and the codecs.

``kv_cache_dtype`` is ``auto`` (K/V kept at the model's dtype), ``int8`` or
``fp8_e4m3``. A quantized pool is a ``uint8`` tensor in the same block-major
order as an unquantized one, ``[num_blocks, num_layers, 2, kv_heads, tile]``,
where one tile (a block's tokens of one layer, K or V, one head) is

    [block_size * head_dim codes (1 byte each)][block_size scales (bfloat16)]

so the scales live inside the block: a block is still one contiguous region
(one transfer descriptor, one host / disk slot) and its bytes per token are
``2 * layers * kv_heads * (head_dim + 2)``.

Granularity: one scale per token and KV head (LMDeploy's int8 KV does the
same). A token is quantized once, when its K/V enter the pool, and its bytes
never change afterwards: no read-modify-write of a block when a later token
of the block is larger (a per-block scale would need to re-quantize the
block's earlier tokens, compounding rounding errors and making a block's bytes
depend on how its tokens were chunked), the same tokens give the same bytes on
a prefill node and a decode node, and an outlier token costs only itself
precision. The price is 2 bytes per ``head_dim`` codes: 3.1 % at head_dim 64.

A scale is stored as bfloat16 (the range of float32, so no token underflows
or overflows it) and codes are computed against the *stored* scale, so its
rounding adds no error. Zero vectors get the smallest normal scale.

fp8: codes are float8_e4m3fn bytes. Where torch can cast to
``torch.float8_e4m3fn`` on the pool's device (CPU and CUDA in torch >= 2.1)
the cast is used to encode; elsewhere :mod:`engine.kv_fp8` encodes the same
bytes with plain float ops (tests check the two agree bit for bit). Decoding
uses torch's cast on CUDA and :func:`engine.kv_fp8.decode_via_half` (moved
bits, exact) elsewhere: torch's float8 -> float cast is scalar on the CPU. Attention
always dequantizes to the model's dtype and runs its matmuls there: no fp8
matmul runs on any device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import kv_fp8

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
SCALE_DTYPE = torch.bfloat16
SCALE_BYTES = 2


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (auto = the model's "
                         f"dtype), got {name!r}")
    return name


@dataclass(frozen=True)
class KVCacheSpec:
    """How K/V are stored: ``name`` as configured, ``model_dtype`` the dtype attention runs in."""
    name: str = "auto"
    model_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.name)

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        """dtype of the pool tensor."""
        return torch.uint8 if self.quantized else self.model_dtype

    @property
    def qmax(self) -> float:
        return {"int8": 127.0, "fp8_e4m3": 448.0}[self.name]

    def tile_bytes(self, block_size: int, head_dim: int) -> int:
        """Bytes of one (block, layer, k|v, head) tile, scales included."""
        if not self.quantized:
            return block_size * head_dim * torch.empty((), dtype=self.model_dtype).element_size()
        return block_size * (head_dim + SCALE_BYTES)

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one token, scales included (cluster/tools/planner/capacity.py says the same)."""
        return 2 * num_layers * num_kv_heads * self.tile_bytes(1, head_dim)


class KVCodec:
    """Quantize ``[..., head_dim]`` vectors to codes + one scale each, and back."""

    def __init__(self, spec: KVCacheSpec, device: torch.device | str) -> None:
        if not spec.quantized:
            raise ValueError("KVCodec is for int8 / fp8_e4m3 caches; an auto cache stores K/V as they are")
        self.spec = spec
        self.device = torch.device(device)
        self.native_fp8 = spec.name == "fp8_e4m3" and kv_fp8.native_cast_supported(self.device)
        # decoding: torch's float8 cast where it is vectorised (CUDA), moved bits elsewhere (CPU: the
        # cast is element by element there, 6x slower than kv_fp8.decode_via_half)
        self.native_fp8_decode = self.native_fp8 and self.device.type == "cuda"
        self._tiny = torch.finfo(SCALE_DTYPE).tiny

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[..., D]`` -> (uint8 codes ``[..., D]``, bfloat16 scales ``[...]``)."""
        xf = x.float()
        scale = (xf.abs().amax(dim=-1) / self.spec.qmax).clamp_min_(self._tiny).to(SCALE_DTYPE)
        y = xf / scale.float().unsqueeze(-1)
        if self.spec.name == "int8":
            codes = y.round_().clamp_(-127.0, 127.0).to(torch.int8).view(torch.uint8)
        elif self.native_fp8:
            codes = y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            codes = kv_fp8.encode(y.clamp_(-448.0, 448.0))
        return codes, scale

    def decode_codes(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 codes -> unscaled values in ``dtype``."""
        if self.spec.name == "int8":
            return codes.view(torch.int8).to(dtype)
        if self.native_fp8_decode:
            return codes.view(torch.float8_e4m3fn).to(dtype)
        return kv_fp8.decode_via_half(codes, dtype)

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.decode_codes(codes, dtype).mul_(scale.to(dtype).unsqueeze(-1))

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What attention reads back for ``x`` after it went through the pool."""
        return self.dequantize(*self.quantize(x), x.dtype)

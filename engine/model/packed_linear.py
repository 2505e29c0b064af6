"""Linear layers on oneDNN's pre-packed (blocked) weights, on CPU.

``F.linear`` on a plain ``[out, in]`` weight runs MKL's GEMM, which on this repo's 2-core
CPUs reads a decode step's weights at 12 GB/s at batch 1 and is compute-poor at batch 4-64
(benchmarks/step_profile.py, docs/benchmarks.md). oneDNN's ``linear`` on a weight reordered
once into its blocked layout (what inductor's weight freezing does) ran SmolLM2's 30 layers
2.1x faster at batch 1 and 2.2x at batch 32, and no slower at 512 tokens. The packed copy
replaces the plain one (no second copy of the weights is kept).

Packing is used where oneDNN has a fast kernel for the dtype: float32 always, bfloat16 only
where the CPU has bf16 instructions (avx512_bf16 / AMX; elsewhere bf16 GEMMs are emulated);
never float16 or a non-CPU device.
"""
from __future__ import annotations

import torch

from engine.cpu_features import cpu_flags

BATCH_HINT = 32     # oneDNN picks its blocking for this many rows; measured best from 1 to 512 here


def _cpu_has_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _cpu_has_bf16())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` weight -> oneDNN's opaque blocked tensor of the same shape."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

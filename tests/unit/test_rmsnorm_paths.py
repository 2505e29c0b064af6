"""RMSNorm's two fp32 paths (F.rms_norm for few rows, HF's formula for many) agree bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers import RMSNorm


@pytest.mark.parametrize("rows", [1, 7, 32, 33, 300])
def test_rmsnorm_fp32_paths_bit_identical(rows):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=g)
    x = torch.randn(rows, 96, generator=g) * 3
    with torch.inference_mode():
        ref = F.rms_norm(x, (96,), norm.weight, 1e-5)
        hf = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        got = norm(x)
    assert torch.equal(got, ref) and torch.equal(got, hf)

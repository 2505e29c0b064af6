"""Linear layers on oneDNN-packed weights give F.linear's results, and the runner packs
only where it should (CPU, float32; bfloat16 only with bf16 instructions)."""
import pytest
import torch
import torch.nn.functional as F

from engine.model.layers import FusedLinear
from engine.model.packed_linear import can_pack, pack_weight, packed_linear


@pytest.mark.parametrize("rows", [1, 3, 32, 300])
def test_packed_linear_matches_f_linear(rows):
    if not can_pack(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN in this torch build")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 40, generator=g)
    with torch.inference_mode():
        got = packed_linear(x, pack_weight(w), b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_fused_linear_pack_drops_the_plain_weight_and_reload_unpacks():
    if not can_pack(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN in this torch build")
    lin = FusedLinear(8, 12, bias=True)
    w = torch.randn(12, 8)
    lin.load_parts([w[:4], w[4:]], [torch.zeros(4), torch.ones(8)])
    x = torch.randn(2, 8)
    want = lin(x)
    lin.pack()
    assert lin.weight.numel() == 0 and lin.packed is not None
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    lin.load_parts([w[:4], w[4:]], [torch.zeros(4), torch.ones(8)])
    assert lin.packed is None and lin.weight.shape == (12, 8)


def test_can_pack_rules():
    assert not can_pack(torch.device("cpu"), torch.float16)
    assert not can_pack(torch.device("meta"), torch.float32)

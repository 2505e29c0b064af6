"""Building blocks of the Llama-family decoder (inference only, no autograd)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.kernels import cpu_kernel_available
from engine.model.packed_linear import pack_weight, packed_linear
from engine.model.panel_weights import MAX_ROWS, panel_linear

# silu(gate) * up of at most this many gate_up elements runs on one thread (csrc/silu_mul.cpp):
# a decode batch's ~0.1-1 MB costs less than an OpenMP fork/join, more so on a busy host
SERIAL_SILU_MUL_NUMEL = 1 << 18


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = _param(hidden_size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if x.device.type == "cpu" and cpu_kernel_available():   # one pass a row, no fork for a few rows
                return torch.ops.pdserve.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # as HF: normalise in float32, cast back, then scale in the model dtype
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * self.weight


class FusedLinear(nn.Module):
    """One matmul for several projections that share an input (qkv, gate+up)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.shape = (out_features, in_features)
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.packed: torch.Tensor | None = None     # oneDNN's blocked weight, once pack() ran
        self.panels: torch.Tensor | None = None     # 16-output panels for a few rows, once add_panels() ran

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.dim() == 2 and x.shape[0] <= MAX_ROWS:
            return panel_linear(x, self.panels, self.bias, self.shape[0])
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def add_panels(self, panels: torch.Tensor) -> None:
        """Read steps of a few rows from ``panels``, a copy of the weight in 16-output panels
        (engine/model/panel_weights.py)."""
        if tuple(panels.shape[1:]) != (self.shape[1], 16) or panels.shape[0] * 16 < self.shape[0]:
            raise ValueError(f"panels {tuple(panels.shape)} do not hold a {self.shape} weight")
        self.panels = panels

    def pack(self) -> None:
        """Replace the weight by oneDNN's packed copy (engine/model/packed_linear.py)."""
        self.packed = pack_weight(self.weight.data)
        self.weight.data = self.weight.data.new_empty(0)

    def load_parts(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> None:
        w = torch.cat(weights, dim=0)
        if tuple(w.shape) != self.shape:
            raise ValueError(f"fused weight shape {tuple(w.shape)} != expected {self.shape}: "
                             "the checkpoint does not match its config")
        self.weight.data = w.to(self.weight.dtype).to(self.weight.device).contiguous()
        self.packed = self.panels = None
        if self.bias is not None:
            if biases is None:
                raise ValueError("the config says the projection has a bias but the checkpoint has none")
            self.bias.data = torch.cat(biases).to(self.weight.dtype).to(self.weight.device)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up as one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up = FusedLinear(hidden_size, 2 * intermediate_size)
        self.down = FusedLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        if gu.device.type == "cpu" and cpu_kernel_available():   # the same values, no thread fork
            return self.down(torch.ops.pdserve.silu_mul(gu, SERIAL_SILU_MUL_NUMEL))
        gate, up = gu[..., :self.intermediate_size], gu[..., self.intermediate_size:]
        return self.down(F.silu(gate).mul_(up))

"""A few-row step's decoder layers in one C++ call (``torch.ops.pdserve.decoder_layers``).

At batch 1 a decode step's kernels take ~23 ms on SmolLM2 and the Python around them (30
layers, ~10 module calls and dispatches each) another ~7 ms. The op runs the same kernels in
the same order as :class:`engine.model.llama.DecoderLayer` (RMSNorm, the qkv panels, RoPE + the
K/V write, paged attention, o_proj, residual, RMSNorm, gate_up, SwiGLU, down, residual), so
its outputs are bit-identical to the Python loop's; the model uses it for steps of at most
``MAX_ROWS`` rows when its linear layers have panels (float32 on CPU, no tensor parallelism)
and the attention backend's plan is the cpu_paged kernel's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from engine.attention.backend import KernelStepArgs
from engine.model.layers import SERIAL_SILU_MUL_NUMEL, FusedLinear, RMSNorm, SwiGLU


@dataclass(frozen=True)
class LayerStack:
    """Every layer's norm weights and panels, flattened in the op's order."""

    weights: tuple[torch.Tensor, ...]              # 6 a layer
    qkv_bias: tuple[torch.Tensor | None, ...]      # 1 a layer
    out_features: tuple[int, ...]                  # 4 a layer: qkv, o, gate_up, down
    num_heads: int
    eps: float

    @classmethod
    def of(cls, layers: list) -> "LayerStack":
        """From :class:`DecoderLayer` modules whose linear layers all have panels."""
        weights: list[torch.Tensor] = []
        bias: list[torch.Tensor | None] = []
        outs: list[int] = []
        eps = None
        for layer in layers:
            norms: list[RMSNorm] = [layer.input_layernorm, layer.post_attention_layernorm]
            mlp: SwiGLU = layer.mlp
            linears: list[FusedLinear] = [layer.qkv_proj, layer.o_proj, mlp.gate_up, mlp.down]
            panels = [m.panels for m in linears]
            if any(p is None for p in panels):
                raise ValueError("LayerStack needs panels on every linear layer: call pack_weights(panels=True)")
            qkv, o, gate_up, down = cast(list[torch.Tensor], panels)
            if any(n.eps != norms[0].eps for n in norms) or (eps is not None and norms[0].eps != eps):
                raise ValueError("LayerStack needs one RMSNorm eps for every layer")
            eps = norms[0].eps
            weights += [norms[0].weight, qkv, o, norms[1].weight, gate_up, down]
            bias.append(linears[0].bias)
            outs += [m.shape[0] for m in linears]
        if eps is None:
            raise ValueError("LayerStack needs at least one layer")
        return cls(tuple(weights), tuple(bias), tuple(outs), layers[0].num_heads, float(eps))

    def run(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], step: KernelStepArgs) -> torch.Tensor:
        """The residual stream after every layer, ``[T, hidden]``; K/V written to the pool."""
        t = h.shape[0]
        cos, ssin = rope
        return torch.ops.pdserve.decoder_layers(
            h, list(self.weights), list(self.qkv_bias), list(self.out_features), cos.reshape(t, -1),
            ssin.reshape(t, -1), step.slot_mapping, step.pool, step.block_tables, step.query_start_loc,
            step.context_lens, step.scale, self.num_heads, self.eps, SERIAL_SILU_MUL_NUMEL)

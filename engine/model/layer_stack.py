"""A step's decoder layers in one C++ call (``torch.ops.pdserve.decoder_layers``).

At batch 1 a SmolLM2 decode step of ~30 ms spent ~25 ms in its ops and the rest in the Python
between them (30 layers, ~10 module calls and dispatches each; benchmarks/step_profile.py
--op-table). The op runs the same kernels in
the same order as :class:`engine.model.llama.DecoderLayer` (RMSNorm, the qkv projection, RoPE +
the K/V write, paged attention, o_proj, residual, RMSNorm, gate_up, SwiGLU, down, residual), each
projection on its panels for steps of at most ``MAX_ROWS`` rows and on its oneDNN-packed weight
otherwise, as :class:`FusedLinear` picks; so its outputs are bit-identical to the Python loop's.
The model uses it for float32 weights packed on CPU, without tensor parallelism, when the
attention backend's plan is the cpu_paged kernel's (``kernel_step_args``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import KernelStepArgs
from engine.model.layers import SERIAL_SILU_MUL_NUMEL, FusedLinear, RMSNorm, SwiGLU
from engine.model.panel_weights import MAX_ROWS


@dataclass(frozen=True)
class LayerStack:
    """Every layer's norm weights and projections, flattened in the op's order."""

    norms: tuple[torch.Tensor, ...]                # 2 a layer: input, post-attention
    packed: tuple[torch.Tensor, ...]               # 4 a layer: qkv, o, gate_up, down (oneDNN's layout)
    panels: tuple[torch.Tensor, ...]               # the same 4 a layer in 16-output panels, or ()
    qkv_bias: tuple[torch.Tensor | None, ...]      # 1 a layer
    out_features: tuple[int, ...]                  # 4 a layer
    num_heads: int
    eps: float

    @classmethod
    def of(cls, layers: list) -> "LayerStack":
        """From float32 :class:`DecoderLayer` modules whose projections are all packed
        (``pack_weights``); their panels are used when every projection has them."""
        norms: list[torch.Tensor] = []
        packed: list[torch.Tensor] = []
        panels: list[torch.Tensor | None] = []
        bias: list[torch.Tensor | None] = []
        outs: list[int] = []
        eps = None
        for layer in layers:
            pair: list[RMSNorm] = [layer.input_layernorm, layer.post_attention_layernorm]
            mlp: SwiGLU = layer.mlp
            linears: list[FusedLinear] = [layer.qkv_proj, layer.o_proj, mlp.gate_up, mlp.down]
            if any(m.packed is None for m in linears):
                raise ValueError("LayerStack needs every projection packed: call pack_weights() first")
            if any(n.weight.dtype != torch.float32 for n in pair):
                raise ValueError("LayerStack runs float32 layers only; other dtypes keep the Python loop")
            if pair[0].eps != pair[1].eps or (eps is not None and pair[0].eps != eps):
                raise ValueError("LayerStack needs one RMSNorm eps for every layer")
            eps = pair[0].eps
            norms += [n.weight for n in pair]
            packed += [m.packed for m in linears if m.packed is not None]
            panels += [m.panels for m in linears]
            bias.append(linears[0].bias)
            outs += [m.shape[0] for m in linears]
        if eps is None:
            raise ValueError("LayerStack needs at least one layer")
        have = tuple(p for p in panels if p is not None)
        return cls(tuple(norms), tuple(packed), have if len(have) == len(panels) else (), tuple(bias),
                   tuple(outs), layers[0].num_heads, float(eps))

    def run(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], step: KernelStepArgs) -> torch.Tensor:
        """The residual stream after every layer, ``[T, hidden]``; K/V written to the pool."""
        t = h.shape[0]
        cos, ssin = rope
        return torch.ops.pdserve.decoder_layers(
            h, list(self.norms), list(self.panels), list(self.packed), list(self.qkv_bias), list(self.out_features),
            MAX_ROWS, cos.reshape(t, -1), ssin.reshape(t, -1), step.slot_mapping, step.pool, step.block_tables,
            step.query_start_loc, step.context_lens, step.scale, self.num_heads, self.eps, SERIAL_SILU_MUL_NUMEL)

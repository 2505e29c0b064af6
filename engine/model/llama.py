"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a paged KV pool.

RMSNorm, RoPE, grouped-query attention through an :class:`AttentionBackend`,
SwiGLU, optional qkv bias (Qwen2) and tied embeddings. Q/K/V and gate/up are
each one matmul. Weights load from a state dict in Hugging Face naming.
"""
from __future__ import annotations

from typing import Callable, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.batch import BatchInput
from engine.config import ModelConfig
from engine.model.layer_stack import LayerStack
from engine.model.layers import FusedLinear, RMSNorm, SwiGLU, _param
from engine.model.packed_linear import pack_weight, packed_linear
from engine.model.panel_weights import MAX_ROWS, panel_linear, panels_on_huge_pages
from engine.model.rope import RotaryEmbedding


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class DecoderLayer(nn.Module):
    """``reduce`` follows o_proj and down: the identity, or a tensor-parallel all-reduce
    (engine/parallel/) when ``cfg`` is one rank's shard."""

    def __init__(self, cfg: ModelConfig, reduce: Callable[[torch.Tensor], torch.Tensor] = _identity) -> None:
        super().__init__()
        self.reduce = reduce
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = FusedLinear(cfg.hidden_size, qkv_out, bias=cfg.attention_bias)
        self.o_proj = FusedLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, index: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attention: AttentionBackend, plan: object) -> torch.Tensor:
        qkv = self.qkv_proj(self.input_layernorm(h))
        attn = attention.forward_qkv(plan, index, qkv, rope)
        h = h + self.reduce(self.o_proj(attn))
        return h + self.reduce(self.mlp(self.post_attention_layernorm(h)))

    def load_hf(self, sd: dict[str, torch.Tensor], prefix: str) -> None:
        a, m = prefix + "self_attn.", prefix + "mlp."
        self.input_layernorm.weight.data.copy_(sd[prefix + "input_layernorm.weight"])
        self.post_attention_layernorm.weight.data.copy_(sd[prefix + "post_attention_layernorm.weight"])
        qkv = [sd[f"{a}{p}_proj.weight"] for p in "qkv"]
        bias = [sd[f"{a}{p}_proj.bias"] for p in "qkv"] if f"{a}q_proj.bias" in sd else None
        self.qkv_proj.load_parts(qkv, bias)
        self.o_proj.load_parts([sd[a + "o_proj.weight"]])
        self.mlp.gate_up.load_parts([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
        self.mlp.down.load_parts([sd[m + "down_proj.weight"]])


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionBackend, *,
                 device: torch.device | str, dtype: torch.dtype, max_positions: int | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] = _identity) -> None:
        super().__init__()
        self.config = cfg
        self.attention = attention
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, reduce) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        self.lm_head_packed: torch.Tensor | None = None
        self.lm_head_panels: torch.Tensor | None = None
        self.layer_stack: LayerStack | None = None   # the layers in one C++ call, once packed (float32)
        self.to(device=device, dtype=dtype)
        scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                    cfg.rope_theta, scaling, device=device, dtype=dtype)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def hidden_states(self, batch: BatchInput, kv_pool: torch.Tensor,
                      on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Residual stream after the last layer (before the final norm), ``[T, hidden]``.
        ``on_layer(n)`` is called once layers ``[0, n)`` have run (their K/V are in the pool,
        once the device's queued work is done)."""
        plan = self.attention.plan(batch.attn, kv_pool)
        rope = self.rope.tables(batch.positions)
        h = self.embed(batch.input_ids)
        if self.layer_stack is not None and on_layer is None:
            step = self.attention.kernel_step_args(plan)
            if step is not None:   # a cpu_paged float32 plan: every layer in one C++ call
                return self.layer_stack.run(h, rope, step)
        for i, layer in enumerate(self.layers):
            h = layer(i, h, rope, self.attention, plan)
            if on_layer is not None:
                on_layer(i + 1)
        return h

    def forward(self, batch: BatchInput, kv_pool: torch.Tensor,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` in the model dtype; K/V written to the pool."""
        h = self.hidden_states(batch, kv_pool, on_layer)
        h = self.norm(h.index_select(0, batch.logits_indices))
        return self.logits(h)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Normed last hidden states ``[N, hidden]`` -> logits ``[N, vocab]``."""
        if self.lm_head_panels is not None and h.shape[0] <= MAX_ROWS:
            return panel_linear(h, self.lm_head_panels, None, self.config.vocab_size)
        if self.lm_head_packed is not None:
            return packed_linear(h, self.lm_head_packed, None)
        return F.linear(h, self.lm_head_weight)

    def linear_weight_bytes(self) -> int:
        """Bytes of every projection's weight and the LM head's (what a copy of them costs)."""
        linears = sum(m.weight.numel() * m.weight.element_size() for m in self.modules()
                      if isinstance(m, FusedLinear))
        return linears + self.lm_head_weight.numel() * self.lm_head_weight.element_size()

    def pack_weights(self, panels: bool = False) -> None:
        """oneDNN-packed weights for every projection and the LM head (call after loading;
        a tied LM head gets its own packed copy, the embedding stays as it is). ``panels``:
        also a copy in 16-output panels for steps of a few rows (engine/model/panel_weights.py).
        Float32 layers on CPU without tensor parallelism then also get their :class:`LayerStack`
        (every layer of a step in one C++ call)."""
        linears = [m for m in self.modules() if isinstance(m, FusedLinear)]
        if panels:
            *per_linear, self.lm_head_panels = panels_on_huge_pages(
                [m.weight.data for m in linears] + [self.lm_head_weight.data])
            for module, p in zip(linears, per_linear):
                module.add_panels(p)
        for module in linears:
            module.pack()
        if self.embed_tokens.dtype == torch.float32 and self.embed_tokens.device.type == "cpu" and \
                all(cast(DecoderLayer, layer).reduce is _identity for layer in self.layers):
            self.layer_stack = LayerStack.of(list(self.layers))
        self.lm_head_packed = pack_weight(self.lm_head_weight.data)
        if self.lm_head is not None:
            self.lm_head.data = self.lm_head.data.new_empty(0)

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights (fusing qkv and gate/up); raises ValueError on a mismatch."""
        missing = [k for k in ("model.embed_tokens.weight", "model.norm.weight") if k not in sd]
        if self.lm_head is not None and "lm_head.weight" not in sd:
            missing.append("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint lacks {missing}; is it a Llama-family causal LM?")
        emb = sd["model.embed_tokens.weight"]
        if tuple(emb.shape) != tuple(self.embed_tokens.shape):
            raise ValueError(f"embedding shape {tuple(emb.shape)} does not match the config "
                             f"{tuple(self.embed_tokens.shape)}")
        self.embed_tokens.data.copy_(emb)
        self.norm.weight.data.copy_(sd["model.norm.weight"])
        if self.lm_head is not None:
            self.lm_head.data = sd["lm_head.weight"].to(self.embed_tokens.dtype).to(self.embed_tokens.device).clone()
        self.lm_head_packed = self.lm_head_panels = self.layer_stack = None
        try:
            for i, layer in enumerate(self.layers):
                cast(DecoderLayer, layer).load_hf(sd, f"model.layers.{i}.")
        except KeyError as e:
            raise ValueError(f"checkpoint lacks tensor {e.args[0]}; does config.json match the weights?") \
                from None

"""Runs the model for one engine step: SchedulerOutput -> logits.

Owns the model weights and the KV pool. Builds the flat :class:`BatchInput`
with Python lists and one ``torch.tensor`` call per field (this is on the
decode hot path), prefill-like sequences first and decodes after.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from engine.attention.backend import AttentionShape, get_attention_backend
from engine.attention.kernels import cpu_kernel_available
from engine.batch import AttentionMetadata, BatchInput
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.kv_pool import KVPool
from engine.kv_quant import KVCacheSpec
from engine.model.llama import LlamaForCausalLM
from engine.model.packed_linear import can_pack
from engine.model.panel_weights import MAX_ROWS as PANEL_MAX_ROWS
from engine.model.panel_weights import resolve_panel_weights
from engine.parallel.sharded_model import TPShard
from engine.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.tiers.storage import TierStorage
from engine.tiers.types import KVMove

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _tokens(seq: ScheduledSeq, start: int, n: int) -> list[int]:
    req = seq.request
    prompt, out = req.prompt_token_ids, req.output_token_ids
    p = len(prompt)
    if start + n <= p:
        return prompt[start:start + n]
    if start >= p:
        return out[start - p:start - p + n]
    return prompt[start:] + out[:start + n - p]


def _is_decode(seq: ScheduledSeq) -> bool:
    return seq.num_new_tokens == 1 and seq.sample


@dataclass(frozen=True)
class StepInputs:
    batch: BatchInput
    num_sampled: int


class ModelRunner:
    def __init__(self, model_config: ModelConfig, state_dict: dict[str, torch.Tensor], *,
                 cache_config: CacheConfig | None = None, max_model_len: int | None = None,
                 device: torch.device | str = "cpu", dtype: str | torch.dtype = "float32",
                 attention_backend: str = "auto", tp: TPShard | None = None,
                 packed_weights: bool = True, panel_weights: str = "auto") -> None:
        """``tp``: hold one tensor-parallel rank's shard (its heads, its KV pool) of the model;
        ``state_dict`` is then that rank's slices (engine/parallel/shard_loader.py).
        ``packed_weights``: linear layers on oneDNN-packed weights where the device and dtype
        allow (engine/model/packed_linear.py); a tensor-parallel shard keeps plain weights.
        ``panel_weights``: with packed float32 weights on CPU, also a copy in 16-output panels
        for steps of a few rows ("auto", "on", "off"; engine/model/panel_weights.py)."""
        cache_config = cache_config or CacheConfig()
        self.model_config = model_config
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype)
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_config.max_position_embeddings}; lower it")
        local = model_config if tp is None else tp.local_config(model_config)   # this rank's heads
        shape = AttentionShape(local.num_layers, local.num_heads, local.num_kv_heads, local.head_dim,
                               self.block_size)
        self.kv_spec = KVCacheSpec(cache_config.kv_cache_dtype, self.dtype)
        self.attention = get_attention_backend(attention_backend, shape, self.kv_spec)
        with torch.inference_mode():
            if tp is None:
                self.model = LlamaForCausalLM(model_config, self.attention, device=self.device,
                                              dtype=self.dtype, max_positions=self.max_model_len)
                self.model.load_hf_state_dict(state_dict)
                if packed_weights and can_pack(self.device, self.dtype):
                    self.model.pack_weights(panels=self._use_panels(panel_weights))
            else:
                self.model = tp.build_model(model_config, state_dict, self.attention, device=self.device,
                                            dtype=self.dtype, max_positions=self.max_model_len)
        self.model.eval()
        self.kv_pool = KVPool.from_cache_config(local, cache_config, device=self.device,
                                                dtype=self.dtype, max_model_len=self.max_model_len)
        self.tiers = TierStorage.from_cache_config(cache_config, self.kv_pool)

    @classmethod
    def from_engine_config(cls, config: EngineConfig, attention_backend: str | None = None) -> "ModelRunner":
        """Load the weights of ``config.model`` (HF directory or .gguf) and build the runner."""
        from engine.loader import load_model_source

        model_config, state = load_model_source(config.model)
        return cls(model_config, state, cache_config=config.cache,
                   max_model_len=config.scheduler.max_model_len, device=config.device,
                   dtype=config.dtype, attention_backend=attention_backend or config.attention_backend,
                   packed_weights=config.packed_weights, panel_weights=config.panel_weights)

    def _use_panels(self, mode: str) -> bool:
        nbytes = self.model.linear_weight_bytes()
        use = resolve_panel_weights(mode, nbytes) and self.dtype == torch.float32 and cpu_kernel_available()
        if use:
            log.info("model: linear weights also in 16-output panels for steps of <= %d rows (%.0f MB more)",
                     PANEL_MAX_ROWS, nbytes / 1e6)
        return use

    @property
    def num_blocks(self) -> int:
        return self.kv_pool.num_blocks

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def build_inputs(self, sched: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        seqs = sorted(sched.seqs, key=_is_decode)          # stable: prefill-like first
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        ctxs: list[int] = []
        tables: list[list[int]] = []
        last_token: dict[int, int] = {}
        for seq in seqs:
            start, n = seq.request.num_computed_tokens, seq.num_new_tokens
            ctx = start + n
            self._validate(seq, ctx)
            blocks = seq.block_ids[:-(-ctx // bs)]
            ids.extend(_tokens(seq, start, n))
            positions.extend(range(start, ctx))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, ctx))
            last_token[id(seq)] = len(ids) - 1
            qlens.append(n)
            ctxs.append(ctx)
            tables.append(blocks)
        num_prefills = sum(1 for s in seqs if not _is_decode(s))
        width = max(len(t) for t in tables)
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        logits_idx = [last_token[id(s)] for s in sched.seqs if s.sample]

        def t(x) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        attn = AttentionMetadata(
            slot_mapping=t(slots), query_lens=t(qlens), context_lens=t(ctxs),
            query_start_loc=t(qsl), block_tables=t([b + [0] * (width - len(b)) for b in tables]),
            num_prefills=num_prefills, num_prefill_tokens=qsl[num_prefills],
            max_query_len=max(qlens), max_context_len=max(ctxs), block_size=bs)
        batch = BatchInput(input_ids=t(ids), positions=t(positions), attn=attn,
                           logits_indices=t(logits_idx))
        return StepInputs(batch, len(logits_idx))

    def _validate(self, seq: ScheduledSeq, ctx: int) -> None:
        req = seq.request
        if seq.num_new_tokens < 1 or ctx > req.num_tokens:
            raise ValueError(f"request {req.request_id}: cannot compute {seq.num_new_tokens} tokens "
                             f"from {req.num_computed_tokens} (it has {req.num_tokens})")
        if ctx > self.max_model_len:
            raise ValueError(f"request {req.request_id} reaches {ctx} tokens > max_model_len="
                             f"{self.max_model_len}")
        if len(seq.block_ids) * self.block_size < ctx:
            raise ValueError(f"request {req.request_id}: {len(seq.block_ids)} blocks cannot hold "
                             f"{ctx} tokens of block_size {self.block_size}")

    @torch.inference_mode()
    def apply_kv_moves(self, moves: list[KVMove]) -> None:
        """Run block moves (copy-on-write, page-outs, page-ins, swaps) in order."""
        self.tiers.apply(moves)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Move / copy blocks, run the forward; float32 logits ``[num seqs with sample, vocab]``
        in the order those sequences appear in ``sched.seqs``. ``on_layer(n)``: called as the
        forward has run layers ``[0, n)`` (LlamaForCausalLM.hidden_states)."""
        return self.run(sched.moves(), None if sched.is_empty else self.build_inputs(sched), on_layer)

    @torch.inference_mode()
    def run(self, moves: list[KVMove], inputs: StepInputs | None,
            on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Apply ``moves``, then the forward over ``inputs`` (None: nothing scheduled). A
        tensor-parallel rank runs the inputs rank 0 built (engine/parallel/executor.py)."""
        self.tiers.apply(moves)
        if inputs is None:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        if inputs.num_sampled == 0:
            # prefill chunks only: still compute K/V, skip the LM head
            self.model.hidden_states(inputs.batch, self.kv_pool.tensor, on_layer)
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return self.model(inputs.batch, self.kv_pool.tensor, on_layer).float()

    def close(self) -> None:
        """Release what the runner holds beyond memory (a TP executor stops its ranks)."""

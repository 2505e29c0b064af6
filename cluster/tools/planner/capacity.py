"""The KV capacity equations, as pure functions on integers (bytes, tokens).

    kv_bytes_per_token  = 2 (K and V) * layers * kv_heads * head_dim * dtype_bytes
                          (a quantized cache, --kv-cache-dtype int8 / fp8_e4m3: 1 byte a value
                          plus a 2-byte scale per token and KV head, as engine/kv_quant.py stores it:
                          2 * layers * kv_heads * (head_dim + 2))
    kv_bytes_per_seq    = kv_bytes_per_token * context_len
    device_budget       = device_memory - weights - reserve
    seqs (device)       = floor(device_budget / kv_bytes_per_seq)
    seqs (host lent)    = floor((device_budget + host_lent) / kv_bytes_per_seq)
    seqs (shared pfx)   = floor((device_budget + host_lent - prefix_bytes)
                                / (kv_bytes_per_token * (context_len - prefix_len)))

Under tensor parallelism every quantity is per GPU (rank): each rank holds
max(1, ceil(kv_heads / tp)) KV heads of every sequence; once tp > kv_heads the
heads are replicated (a rank still needs a whole head). Weights per rank are
weights / tp, except what pdserve's engine (engine/parallel/sharding.py) keeps
whole on every rank: the RMSNorm weights, and the k_proj / v_proj rows of a
replicated KV head (weights_per_rank below).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

from cluster.tools.planner.model_spec import ModelSpec

KV_DTYPE_BYTES = MappingProxyType({"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1})
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")   # as `pdserve serve --kv-cache-dtype`; auto = --kv-dtype
QUANT_SCALE_BYTES = 2                              # bfloat16 scale per token and KV head (engine/kv_quant.py)


def dtype_bytes(kv_dtype: str) -> int:
    try:
        return KV_DTYPE_BYTES[kv_dtype]
    except KeyError:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; choose one of: {', '.join(KV_DTYPE_BYTES)}") from None


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_nbytes: int,
                       scale_bytes: int = 0) -> int:
    """``scale_bytes``: per token and KV head, stored beside the values (a quantized cache)."""
    return 2 * num_layers * num_kv_heads * (head_dim * dtype_nbytes + scale_bytes)


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one tensor-parallel rank stores: split, and at least one whole head."""
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
    return max(1, math.ceil(num_kv_heads / tp))


def kv_replication(num_kv_heads: int, tp: int) -> float:
    """Copies of each KV head across the TP group (1.0 = no replication)."""
    return tp * kv_heads_per_rank(num_kv_heads, tp) / num_kv_heads


def weights_per_rank(model: ModelSpec, weights: int, tp: int) -> int:
    """Weight bytes on one of ``tp`` ranks: the sharded part split, plus the norms whole and the
    k/v projections of the rank's ``kv_heads_per_rank`` heads (replicated once tp > kv_heads)."""
    if tp == 1:
        return weights
    per_param = weights / model.num_params if model.num_params else 2.0
    kv_proj = per_param * 2 * model.num_layers * model.hidden_size * model.num_kv_heads * model.head_dim
    norms = per_param * (2 * model.num_layers + 1) * model.hidden_size
    kv_rank = kv_proj * kv_heads_per_rank(model.num_kv_heads, tp) / model.num_kv_heads
    return math.ceil((weights - kv_proj - norms) / tp + kv_rank + norms)


def sequences_that_fit(budget_bytes: int, bytes_per_sequence: int) -> int:
    if bytes_per_sequence <= 0:
        raise ValueError("bytes per sequence must be positive: check the context length")
    return max(0, budget_bytes) // bytes_per_sequence


def sequences_with_shared_prefix(budget_bytes: int, prefix_bytes: int, unique_bytes_per_sequence: int) -> int:
    """The prefix is stored once; every sequence adds only its own tokens."""
    if budget_bytes < prefix_bytes:
        return 0
    return sequences_that_fit(budget_bytes - prefix_bytes, unique_bytes_per_sequence)


@dataclass(frozen=True)
class CapacityInputs:
    """One accelerator (rank) and what it serves. Sizes in bytes."""
    device_memory: int
    weights: int
    context_len: int
    kv_dtype: str = "fp16"
    host_memory: int = 0          # host DRAM lent to KV, whole TP group (split over ranks)
    reserve: int = 0              # activations, workspace, fragmentation
    shared_prefix_len: int = 0
    tp: int = 1
    kv_cache_dtype: str = "auto"  # int8 / fp8_e4m3: pdserve's quantized cache (overrides kv_dtype)

    @property
    def kv_value_bytes(self) -> tuple[int, int]:
        """(bytes per value, scale bytes per token and KV head)."""
        if self.kv_cache_dtype == "auto":
            return dtype_bytes(self.kv_dtype), 0
        return 1, QUANT_SCALE_BYTES

    @property
    def kv_label(self) -> str:
        return self.kv_dtype if self.kv_cache_dtype == "auto" else f"{self.kv_cache_dtype} (+scales)"

    def __post_init__(self) -> None:
        if self.device_memory <= 0:
            raise ValueError(f"--device-memory must be positive, e.g. '80GiB'; got {self.device_memory}")
        for name in ("weights", "host_memory", "reserve"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 bytes, got {getattr(self, name)}")
        if self.context_len < 1:
            raise ValueError(f"--context-len must be >= 1 token, got {self.context_len}")
        if not 0 <= self.shared_prefix_len < self.context_len:
            raise ValueError(f"--shared-prefix-len must be in [0, context-len) = [0, {self.context_len}), "
                             f"got {self.shared_prefix_len}")
        if self.tp < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp}")
        dtype_bytes(self.kv_dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)} (auto = --kv-dtype), "
                             f"got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class Capacity:
    """Per-rank figures (equal to the whole model's when tp == 1)."""
    tp: int
    kv_bytes_per_token_model: int     # all heads, one copy
    kv_heads_per_rank: int
    kv_replication: float
    kv_bytes_per_token: int           # per rank
    kv_bytes_per_sequence: int        # per rank, at context_len
    weights_per_rank: int
    device_kv_budget: int             # may be negative: weights do not fit
    host_kv_budget: int
    shared_prefix_bytes: int
    sequences_device: int
    sequences_with_host: int
    sequences_with_shared_prefix: int


def plan_capacity(model: ModelSpec, inputs: CapacityInputs) -> Capacity:
    nbytes, scale = inputs.kv_value_bytes
    heads = kv_heads_per_rank(model.num_kv_heads, inputs.tp)
    per_token = kv_bytes_per_token(model.num_layers, heads, model.head_dim, nbytes, scale)
    per_seq = per_token * inputs.context_len
    weights_rank = weights_per_rank(model, inputs.weights, inputs.tp)
    device_budget = inputs.device_memory - weights_rank - inputs.reserve
    host_budget = inputs.host_memory // inputs.tp
    prefix_bytes = per_token * inputs.shared_prefix_len
    unique_per_seq = per_token * (inputs.context_len - inputs.shared_prefix_len)
    # weights that do not fit leave nothing to serve from, host memory or not
    usable = device_budget + host_budget if device_budget >= 0 else 0
    return Capacity(
        tp=inputs.tp,
        kv_bytes_per_token_model=kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, nbytes,
                                                    scale),
        kv_heads_per_rank=heads,
        kv_replication=kv_replication(model.num_kv_heads, inputs.tp),
        kv_bytes_per_token=per_token,
        kv_bytes_per_sequence=per_seq,
        weights_per_rank=weights_rank,
        device_kv_budget=device_budget,
        host_kv_budget=host_budget,
        shared_prefix_bytes=prefix_bytes,
        sequences_device=sequences_that_fit(device_budget, per_seq),
        sequences_with_host=sequences_that_fit(usable, per_seq),
        sequences_with_shared_prefix=sequences_with_shared_prefix(usable, prefix_bytes, unique_per_seq),
    )


def tp_sweep(model: ModelSpec, inputs: CapacityInputs, degrees: tuple[int, ...] = (1, 2, 4, 8, 16)) -> list[Capacity]:
    """plan_capacity at each TP degree (plus the requested one), same per-GPU memory."""
    from dataclasses import replace
    return [plan_capacity(model, replace(inputs, tp=tp)) for tp in sorted(set(degrees) | {inputs.tp})]

"""Typed, frozen configuration of one node's engine."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2)."""
    architecture: str                 # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] | None = None   # items of HF's rope_scaling dict
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # qkv bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None            # explicit count wins over the memory budget
    kv_cache_memory_bytes: int = 1 << 30     # budget for the KV pool when num_blocks is None
    enable_prefix_caching: bool = True
    # lower tiers (docs/tiering.md): host DRAM, then disk; 0 bytes = off
    host_kv_memory_bytes: int = 0
    num_host_blocks: int | None = None       # explicit count wins over host_kv_memory_bytes
    disk_kv_dir: str = ""                    # directory of the disk tier's file
    disk_kv_bytes: int = 0                   # the disk tier's file never exceeds this
    num_disk_blocks: int | None = None       # explicit count wins over disk_kv_bytes
    preemption_mode: str = "auto"            # auto (cost rule) | swap | recompute
    kv_cache_dtype: str = "auto"             # auto (the model's dtype) | int8 | fp8_e4m3 (engine/kv_quant.py)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory must be positive, e.g. '1GiB'")
        for name in ("host_kv_memory_bytes", "disk_kv_bytes", "num_host_blocks", "num_disk_blocks"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0 (0 turns the tier off), got {getattr(self, name)}")
        if (self.disk_kv_bytes or self.num_disk_blocks) and not self.disk_kv_dir:
            raise ValueError("the disk tier has a size but no directory: set disk_kv_dir "
                             "(or set disk_kv_bytes to 0)")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode must be auto, swap or recompute, got {self.preemption_mode!r}")
        if self.kv_cache_dtype not in ("auto", "int8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto, int8 or fp8_e4m3 (auto = the model's dtype), "
                             f"got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048   # token budget per engine step
    max_num_seqs: int = 64               # running sequences at once
    max_model_len: int | None = None     # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    max_waiting: int = 0                 # queued, not yet running: add_request refuses more (QueueFull); 0 = no bound
    queue_order: str = "fcfs"            # waiting requests' admission order: fcfs | fewest_uncached (engine/queue_order.py)
    queue_max_pass_s: float = 20.0       # fewest_uncached: after this long in the queue a request goes in FCFS order
    # a step that carries a prompt's last prefill chunk takes no chunk that would not finish its prompt
    # (whole prompts and decodes still join): its first token does not wait for a newcomer's first chunk;
    # for devices whose step time is linear in tokens (CPU; docs/benchmarks.md, fin35)
    final_chunk_unpadded: bool = False

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 (0 = no bound), got {self.max_waiting}")
        from engine.queue_order import make_queue_order

        make_queue_order(self.queue_order, self.queue_max_pass_s)


@dataclass(frozen=True)
class EngineConfig:
    model: str                         # HF directory or .gguf path
    device: str = "cpu"
    dtype: str = "float32"             # "float32" | "bfloat16" | "float16"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    step_trace_size: int = 0           # > 0: keep the last N steps' timings (engine/step_trace.py)
    tensor_parallel_size: int = 1      # ranks one model is split over (engine/parallel/)
    packed_weights: bool = True        # CPU: linear layers on oneDNN-packed weights (engine/model/packed_linear.py)
    # CPU float32, packed: also keep the linear weights in 16-output panels, read by a kernel that
    # streams them faster in steps of <= 8 rows (batch-1..8 decodes); costs the weights' memory
    # again. "auto": on when that copy is at most 1/8 of the memory (a container's limit where lower;
    # engine/model/panel_weights.py)
    panel_weights: str = "auto"
    attention_backend: str = "auto"    # "auto" (cpu_paged where its kernel builds, else torch_paged) or a name
                                       # from engine.attention.available_backends()
    # > 1: a prefill_only request's last prompt chunk reports its layers in this many groups while
    # it computes (StepDelta.computed_layers; engine/layer_progress.py), all groups but the last
    prompt_layer_groups: int = 1
    # pin the stepping thread's OpenMP team to cores: "off", "auto" or a core list "0-1"
    # (engine/thread_pinning.py)
    omp_threads_bind: str = "off"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1 (1 = no tensor parallelism), "
                             f"got {self.tensor_parallel_size}")
        if self.step_trace_size < 0:
            raise ValueError(f"step_trace_size must be >= 0 records (0 = off), got {self.step_trace_size}")
        if self.prompt_layer_groups < 1:
            raise ValueError(f"prompt_layer_groups must be >= 1 (1 = no layer progress), got {self.prompt_layer_groups}")
        from engine.model.panel_weights import check_panel_mode

        check_panel_mode(self.panel_weights)
        if not self.attention_backend:
            raise ValueError("attention_backend must be 'auto' or a backend name such as 'torch_paged'")
        from engine.thread_pinning import parse_bind

        parse_bind(self.omp_threads_bind)
        if self.omp_threads_bind != "off" and self.tensor_parallel_size > 1:
            raise ValueError("omp_threads_bind pins rank 0's threads only: with tensor_parallel_size > 1 "
                             "set it to 'off'")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

"""`pdserve serve` configuration: one typed, frozen object.

Sources, lowest to highest precedence: defaults, a YAML file (`--config`),
environment variables `PDSERVE_<KEY>` (upper case), command-line flags.
YAML keys and env names are the field names below; flags are the same
names with dashes (`--grpc-port`). The Helm chart renders exactly these keys.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from cluster.observability.log_levels import parse_log_levels
from engine.queue_order import make_queue_order

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "ki": 2**10, "kib": 2**10,
          "m": 10**6, "mb": 10**6, "mi": 2**20, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gi": 2**30, "gib": 2**30,
          "t": 10**12, "tb": 10**12, "ti": 2**40, "tib": 2**40}

ROUTER_POLICIES = ("prefix_aware", "round_robin", "least_loaded")
PREEMPTION_MODES = ("auto", "swap", "recompute")
TRANSFER_BACKENDS = ("auto", "nixl", "ucxx", "tcp")
PREFILL_FAILURE_POLICIES = ("recompute", "reprefill")
FIRST_TOKEN_RELEASES = ("prefill", "decode")   # when a hand-off's first token reaches the client
DTYPES = ("float32", "bfloat16", "float16")
_DEVICE_RE = re.compile(r"^(cpu|cuda|xpu|mps)(:\d+)?$")
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")


def parse_size(value: str | int) -> int:
    """'1GiB' -> 1073741824; plain integers are bytes."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"cannot read size {value!r}: write e.g. '512MiB', '2GiB' or a byte count")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


@dataclass(frozen=True)
class ServeConfig:
    # model and engine
    model: str = ""                       # HF dir, .gguf or cached HF model id; "" = the default SmolLM2 GGUF
    served_model_name: tuple[str, ...] = ()   # names requests may use; the first is listed; () = from model
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_memory: str = "1GiB"         # per worker
    num_kv_blocks: int = 0                # > 0 overrides kv_cache_memory
    kv_cache_dtype: str = "auto"          # auto (= dtype) | int8 | fp8_e4m3: how the KV pool stores K/V
    # KV tiers below the device (docs/tiering.md); "0" = off
    host_kv_memory: str = "0"             # per worker: host DRAM lent to the KV cache
    disk_kv_dir: str = ""                 # directory of the disk tier's file
    disk_kv_bytes: str = "0"              # per worker: the disk tier's file never exceeds this
    preemption_mode: str = "auto"         # auto (cost rule: swap vs recompute) | swap | recompute
    max_model_len: int = 0                # 0 = the model's own context (max_position_embeddings)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    queue_order: str = "fcfs"             # waiting requests' admission order on every worker (engine/queue_order.py)
    queue_max_pass_s: float = 20.0        # fewest_uncached: after this long in a queue a request goes in FCFS order
    final_chunk_unpadded: bool = False       # a step finishing a prefill takes no partial chunk (SchedulerConfig)
    # endpoints
    host: str = "127.0.0.1"
    grpc_port: int = 50051                # 0 = off (then http_port must be on)
    metrics_port: int = 9400
    http_port: int = 8000                 # 0 = off (then grpc_port must be on)
    # pools
    prefill_workers: int = 1
    decode_workers: int = 1
    colocated: bool = False               # workers do both phases, no handoff
    # tensor parallelism (docs/tensor_parallel.md): ranks (Ray actors) one worker's model is split over
    tensor_parallel_size: int = 1         # both pools
    prefill_tensor_parallel_size: int = 0   # 0 = tensor_parallel_size
    decode_tensor_parallel_size: int = 0    # 0 = tensor_parallel_size (colocated workers too)
    cpus_per_worker: float = 1.0
    worker_niceness: int = 15             # nice of worker actors in a Ray cluster pdserve starts (Ray's default)
    gpus_per_worker: float = 0.0
    torch_threads: int = 1
    # Ray custom resources each pool's actors request ("" = no pinning); the
    # Helm chart's worker groups advertise them, a local cluster advertises both
    prefill_resource: str = "pdserve_prefill"
    decode_resource: str = "pdserve_decode"
    # autoscaling (docs/autoscaling.md): each pool sized to the SLOs, within its bounds
    autoscale: bool = False
    slo_ttft_ms: float = 2000.0           # time to first token the prefill pool is sized for (p90)
    slo_itl_ms: float = 200.0             # inter-token latency the decode pool is sized for (p90)
    min_prefill_workers: int = 1
    max_prefill_workers: int = 0          # 0 = prefill_workers (no growth)
    min_decode_workers: int = 1
    max_decode_workers: int = 0           # 0 = decode_workers (no growth)
    autoscale_interval: float = 5.0       # seconds between the controller's decisions
    autoscale_cooldown_s: float = 60.0    # no scale-in for this long after a change, nor before the load
                                          # stayed low this long; no scale-out for half of it after one
    autoscale_prefill_tokens_per_s: float = 0.0   # one prefill worker's prompt tokens/s; 0 = measured
    autoscale_decode_seqs_per_worker: int = 0      # sequences one decode worker holds; 0 = measured
    # > 0: the wait-miss fraction (measured either way) decides prefill's SLO with this budget;
    # 0: the TTFT p90 does (docs/autoscaling.md)
    autoscale_ttft_miss_budget: float = 0.0
    # both pools together may hold at most this many workers (draining ones included): the GPUs
    # the fleet owns; at the cap the controller moves workers between the pools (0 = no cap)
    autoscale_max_total_workers: int = 0
    # routing
    router_policy: str = "prefix_aware"
    router_temperature: float = 0.0       # 0 = pick the minimum cost
    local_prefill_threshold: int = 64     # uncached prompt tokens at or below: decode prefills itself
    local_prefill_hit_ratio: float = 0.8  # decode holds >= this share of the prefix: prefill locally
    router_track_in_flight: bool = True   # count prefixes sent to a node before it reports them
    # a prefill node's cached prefix under this share of the prompt counts as no hit (a short preamble
    # every conversation shares then places nothing; cluster/router/cost.py); 0 = every hit counts
    router_min_hit_share: float = 0.0
    # >= 0: hold arriving requests at the frontend, in one FIFO, while every prefill node has more
    # prompt tokens than this outstanding (sent, prefill not ended), and route each when a prefill
    # ends and leaves room (late binding: cluster/orchestration/prefill_gate.py); -1 = route on arrival
    prefill_queue_limit: int = -1
    # transfer and leases
    transfer_backend: str = "auto"
    lease_ttl: float = 30.0               # seconds a prefill node pins handed-off blocks
    transfer_timeout: float = 10.0
    reserve_decode_blocks: bool = True    # reserve the decode node's KV blocks while the prompt is prefilled
    pipelined_handoff: bool = True        # ... and read the prompt's blocks as prefill chunks complete them
    handoff_layer_groups: int = 8         # ... and the last chunk's in this many layer groups while it computes
    first_token_release: str = "decode"   # hold P's first token until D admitted the request, or stream it at once
    # admission
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1_000_000
    max_worker_queue: int = 256           # requests a worker queues (not yet running) before refusing more
    decode_rebalance_interval: float = 1.0   # s between moves of hand-offs waiting for room on one decode
                                             # worker to decode workers with free batch slots (0 = off)
    step_trace_size: int = 0              # > 0: each worker keeps its last N engine steps' timings
    request_timeout: float = 600.0
    stream_write_timeout: float = 30.0    # a streaming client that accepts no response this long is dropped
    max_migrations: int = 2               # times a request may move after its decode worker died
    drain_timeout: float = 30.0           # SIGTERM: seconds in-flight requests get to finish
    prefill_failure_policy: str = "recompute"   # prefill node lost: recompute on decode, or reprefill
    # security (all optional)
    api_keys_file: str = ""               # lines of "key [tenant]"; env PDSERVE_API_KEYS also works
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""          # set: clients must present a certificate (mutual TLS)
    # ray
    address: str = ""                     # "" = start a local Ray cluster
    ray: bool = True                      # False (--no-ray): one colocated engine in this process
    ray_temp_dir: str = ""
    log_level: str = "INFO"
    cluster_secret_file: str = ""         # the KV side channels' shared secret ("" = a random one per deployment)

    def __post_init__(self) -> None:
        parse_log_levels(self.log_level)
        self._check_model()
        self._check_routing()
        self._check_pools()
        self._check_limits()
        self._check_kv_cache()
        _check_autoscale(self)

    def _check_model(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not _DEVICE_RE.match(self.device) or self.device.startswith(("cpu:", "mps:")):
            raise ValueError(f"device must be cpu, cuda, cuda:N, xpu[:N] or mps, got {self.device!r}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0 tokens (0 = the model's own context), "
                             f"got {self.max_model_len}")
        for name in self.served_model_name:
            if not isinstance(name, str) or not name.strip() or name != name.strip():
                raise ValueError(f"served_model_name {name!r}: give non-empty names without surrounding spaces")

    def _check_routing(self) -> None:
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {', '.join(ROUTER_POLICIES)}, "
                             f"got {self.router_policy!r}")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer_backend must be one of {', '.join(TRANSFER_BACKENDS)}, "
                             f"got {self.transfer_backend!r}")
        if self.first_token_release not in FIRST_TOKEN_RELEASES:
            raise ValueError(f"first_token_release must be one of {', '.join(FIRST_TOKEN_RELEASES)} (prefill: "
                             f"stream the first token as the prefill node samples it; decode: once the decode "
                             f"node has taken the request into its batch), got {self.first_token_release!r}")
        if self.prefill_failure_policy not in PREFILL_FAILURE_POLICIES:
            raise ValueError(f"prefill_failure_policy must be one of {', '.join(PREFILL_FAILURE_POLICIES)}, "
                             f"got {self.prefill_failure_policy!r}")
        if not 0.0 <= self.router_min_hit_share < 1.0:
            raise ValueError(f"router_min_hit_share is the share of a prompt a prefill node's cached prefix must cover "
                             f"to count for routing: give a value in [0, 1) (0: every hit counts), "
                             f"got {self.router_min_hit_share}")
        if self.prefill_queue_limit < -1:
            raise ValueError(f"prefill_queue_limit must be -1 (route on arrival) or >= 0 prompt tokens outstanding "
                             f"on every prefill node before arrivals are held, got {self.prefill_queue_limit}")

    def _check_pools(self) -> None:
        for name in ("prefill_workers", "decode_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.decode_workers < 1:
            raise ValueError("decode_workers must be >= 1: someone has to stream tokens")
        if not self.colocated and self.prefill_workers < 1:
            raise ValueError("prefill_workers must be >= 1 unless --colocated is set")
        for name in ("grpc_port", "metrics_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be a TCP port (0-65535)")
        _check_tp(self)
        if not 0 <= self.worker_niceness <= 19:
            raise ValueError(f"worker_niceness must be 0-19 (0 = the frontend's priority, 15 = Ray's default), "
                             f"got {self.worker_niceness}")

    def _check_limits(self) -> None:
        if self.step_trace_size < 0:
            raise ValueError(f"step_trace_size must be >= 0 records (0 = off), got {self.step_trace_size}")
        make_queue_order(self.queue_order, self.queue_max_pass_s)
        if self.decode_rebalance_interval < 0:
            raise ValueError(f"decode_rebalance_interval must be >= 0 seconds (0 = off), "
                             f"got {self.decode_rebalance_interval}")
        if self.max_worker_queue < 0:
            raise ValueError(f"max_worker_queue must be >= 0 (0 = no bound), got {self.max_worker_queue}")
        if self.stream_write_timeout < 0:
            raise ValueError(f"stream_write_timeout must be >= 0 seconds (0 = no bound), got {self.stream_write_timeout}")
        if self.handoff_layer_groups < 1:
            raise ValueError(f"handoff_layer_groups must be >= 1 (1 = the last chunk's blocks all after the first "
                             f"token), got {self.handoff_layer_groups}")
        if self.lease_ttl <= 0 or self.transfer_timeout <= 0:
            raise ValueError("lease_ttl and transfer_timeout must be positive seconds")

    def _check_kv_cache(self) -> None:
        parse_size(self.kv_cache_memory)
        parse_size(self.host_kv_memory)
        if parse_size(self.disk_kv_bytes) and not self.disk_kv_dir:
            raise ValueError("disk_kv_bytes is set but disk_kv_dir is empty: give the disk tier a directory")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (auto = the model's "
                             f"dtype), got {self.kv_cache_dtype!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")

    def pool_bounds(self, pool: str) -> tuple[int, int]:
        """(min, max) workers of "prefill" or "decode" (colocated workers count as decode);
        without autoscaling both are the configured size."""
        size = self.prefill_workers if pool == "prefill" else self.decode_workers
        if not self.autoscale:
            return size, size
        low, high = ((self.min_prefill_workers, self.max_prefill_workers) if pool == "prefill"
                     else (self.min_decode_workers, self.max_decode_workers))
        return low, high or size

    def pool_tp_size(self, pool: str) -> int:
        """Ranks per worker of "prefill" or "decode" / "colocated"."""
        own = self.prefill_tensor_parallel_size if pool == "prefill" else self.decode_tensor_parallel_size
        return own or self.tensor_parallel_size

    @property
    def kv_cache_memory_bytes(self) -> int:
        return parse_size(self.kv_cache_memory)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_sources(cls, yaml_path: str | None = None, env: Mapping[str, str] | None = None,
                     overrides: Mapping[str, Any] | None = None) -> "ServeConfig":
        values: dict[str, Any] = {}
        if yaml_path:
            values.update(_coerce(_read_yaml(yaml_path), lambda k: f"{yaml_path}: key {k!r}"))
        values.update(_coerce(_read_env(os.environ if env is None else env),
                              lambda k: f"PDSERVE_{k.upper()} (config key {k!r})"))
        values.update(_coerce({k: v for k, v in (overrides or {}).items() if v is not None},
                              lambda k: f"config key {k!r}"))
        return cls(**values)


def _check_tp(cfg: ServeConfig) -> None:
    """The sizes alone (whether the model splits that way is checked at start-up, with the model:
    cluster/orchestration/tp_placement.py)."""
    if cfg.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1 ranks per worker (1 = no tensor parallelism), "
                         f"got {cfg.tensor_parallel_size}")
    for name in ("prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name} must be >= 1 ranks per worker, or 0 to use tensor_parallel_size, "
                             f"got {getattr(cfg, name)}")
    tp = max(cfg.pool_tp_size("prefill"), cfg.pool_tp_size("decode"))
    if tp > 1 and cfg.transfer_backend == "ucxx":
        raise ValueError("the ucxx transfer backend cannot hand KV between tensor-parallel ranks (head ranges): "
                         "use transfer_backend nixl, tcp or auto")
    if tp > 1 and cfg.device.startswith("cuda") and cfg.gpus_per_worker != 1:
        raise ValueError(f"tensor parallelism on {cfg.device} gives each rank its own GPU: set "
                         f"gpus_per_worker to 1 (a worker then holds its TP size in GPUs), got {cfg.gpus_per_worker}")


def _check_fleet_cap(cfg: ServeConfig) -> None:
    cap = cfg.autoscale_max_total_workers
    if cap < 0:
        raise ValueError(f"autoscale_max_total_workers is a number of workers, >= 0 (0: no fleet cap), got {cap}")
    if not cap or not cfg.autoscale:
        return
    if cfg.colocated:
        raise ValueError("autoscale_max_total_workers caps the prefill and decode pools together; colocated "
                         "workers form one pool: bound it with max_decode_workers and leave the cap at 0")
    start = cfg.prefill_workers + cfg.decode_workers
    floor = cfg.min_prefill_workers + cfg.min_decode_workers
    if cap < max(start, floor):
        raise ValueError(f"autoscale_max_total_workers ({cap}) must hold the start sizes (prefill_workers + "
                         f"decode_workers = {start}) and the minimums (min_prefill_workers + min_decode_workers = "
                         f"{floor}): raise it to at least {max(start, floor)} or lower those")


def _check_autoscale(cfg: ServeConfig) -> None:
    if cfg.slo_ttft_ms <= 0 or cfg.slo_itl_ms <= 0 or cfg.autoscale_interval <= 0:
        raise ValueError("slo_ttft_ms, slo_itl_ms and autoscale_interval must be positive")
    if cfg.autoscale_cooldown_s < 0 or cfg.autoscale_prefill_tokens_per_s < 0 or \
            cfg.autoscale_decode_seqs_per_worker < 0:
        raise ValueError("autoscale_cooldown_s, autoscale_prefill_tokens_per_s and "
                         "autoscale_decode_seqs_per_worker must be >= 0 (0 = measured, for the capacities)")
    if not 0 <= cfg.autoscale_ttft_miss_budget < 1:
        raise ValueError(f"autoscale_ttft_miss_budget is a part of the requests, in [0, 1) (0: the TTFT p90 "
                         f"decides), got {cfg.autoscale_ttft_miss_budget}")
    _check_fleet_cap(cfg)
    if not cfg.autoscale:
        return
    for pool in (("decode",) if cfg.colocated else ("prefill", "decode")):
        low, high = cfg.pool_bounds(pool)
        size = cfg.prefill_workers if pool == "prefill" else cfg.decode_workers
        if not 1 <= low <= size <= high:
            raise ValueError(f"autoscale: need 1 <= min_{pool}_workers ({low}) <= {pool}_workers ({size}) <= "
                             f"max_{pool}_workers ({high}); {pool}_workers is the size it starts at")


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config file must be a mapping of key: value")
    data = {str(k).replace("-", "_"): v for k, v in data.items() if v is not None}   # `key:` alone = default
    unknown = sorted(set(data) - set(ServeConfig.keys()))
    if unknown:
        raise ValueError(f"{path}: unknown config keys {unknown}; valid keys: {', '.join(ServeConfig.keys())}")
    return data


def _read_env(env: Mapping[str, str]) -> dict[str, Any]:
    out = {}
    for key in ServeConfig.keys():
        name = "PDSERVE_" + key.upper()
        if name in env:
            out[key] = env[name]
    return out


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(values: dict[str, Any], where) -> dict[str, Any]:
    """Each value as its field's type, strictly: a bool is one of true/false/yes/no/on/off/1/0
    (any case), not "anything else is false". `where(key)` names the source in errors."""
    types = {f.name: f.type for f in fields(ServeConfig)}
    out = {}
    for k, v in values.items():
        t = types[k]
        try:
            if t == "bool":
                out[k] = _bool(v)
            elif t == "int":
                if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
                    raise ValueError
                out[k] = int(v)
            elif t == "float":
                if isinstance(v, bool):
                    raise ValueError
                out[k] = float(v)
            elif t.startswith("tuple"):
                out[k] = _names(v)
            else:
                if isinstance(v, (dict, list, tuple)):
                    raise ValueError
                out[k] = str(v) if t == "str" else v
        except (TypeError, ValueError):
            hint = " (write true or false)" if t == "bool" else ""
            raise ValueError(f"{where(k)}: cannot read {v!r} as {t}{hint}") from None
    return out


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:
        return v.strip().lower() in _TRUE
    raise ValueError(v)


def _names(v: Any) -> tuple[str, ...]:
    """A list of names, or one string of names separated by commas or spaces."""
    if isinstance(v, str):
        return tuple(n for n in re.split(r"[,\s]+", v) if n)
    if isinstance(v, (list, tuple)) and all(isinstance(n, str) for n in v):
        return tuple(v)
    raise ValueError(v)


def replace(cfg: ServeConfig, **changes: Any) -> ServeConfig:
    return dataclasses.replace(cfg, **changes)

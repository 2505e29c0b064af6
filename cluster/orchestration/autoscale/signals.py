"""What the autoscaling controller reads each interval, and what the operator sets.

Everything here is a frozen value: the caller (the live head, or the simulator)
builds one `FleetSignals` per interval from what the router and workers already
report, and keeps one `AutoscaleConfig` for the run. Nothing here does I/O.

Per-worker capacity figures (`PrefillSignals.tokens_per_s_per_worker`,
`DecodeSignals.seqs_per_worker`) come from the caller: the planner's capacity
model (cluster/tools/planner/capacity.py `sequences_that_fit`, pools.py speeds)
or a cost model; the controller does not import them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillSignals:
    """The prefill pool over the last window.

    ``workers``: workers the pool holds or is starting (the last target);
    ``ready_workers``: of those, the ones taking requests.
    ``queued_tokens``: prompt tokens waiting to be prefilled, summed over the pool
    (the router's ``WorkerLoad.queued_prefill_tokens``).
    ``prompt_tokens_per_s``: prompt tokens arriving per second that need computing
    (prompt minus the prefix-cache hit the router expects), over the window.
    ``ttft_p90_ms``: p90 time to first token of requests whose first token came in
    the window (None: none did).
    ``tokens_per_s_per_worker``: prompt tokens/s one worker sustains (capacity).
    ``ttft_wait_miss_fraction``: of the requests whose first token came in the
    window and whose prefill alone (no queueing) fits the TTFT target, the part
    that missed it: the misses more prefill workers could have prevented
    (None: not measured; the TTFT p90 decides instead). A prompt too long to
    meet the target on an idle worker is no reason to grow the pool.
    ``since_last_prompt_s``: seconds since the router last took a prompt (None:
    not tracked; then a zero ``prompt_tokens_per_s`` marks the start of a lull,
    which a rate over a window reports a window late).
    """
    workers: int
    ready_workers: int
    queued_tokens: int
    prompt_tokens_per_s: float
    ttft_p90_ms: float | None
    tokens_per_s_per_worker: float
    ttft_wait_miss_fraction: float | None = None
    since_last_prompt_s: float | None = None

    def __post_init__(self) -> None:
        _check_counts("prefill", self.workers, self.ready_workers)
        if self.queued_tokens < 0 or self.prompt_tokens_per_s < 0:
            raise ValueError(f"prefill signals: queued_tokens and prompt_tokens_per_s must be >= 0, got {self}")
        if self.since_last_prompt_s is not None and self.since_last_prompt_s < 0:
            raise ValueError(f"prefill signals: since_last_prompt_s is an age in seconds, >= 0 (or None), "
                             f"got {self.since_last_prompt_s}")
        if self.ttft_wait_miss_fraction is not None and not 0 <= self.ttft_wait_miss_fraction <= 1:
            raise ValueError(f"prefill signals: ttft_wait_miss_fraction is a part of the window's requests, "
                             f"0..1 (or None), got {self.ttft_wait_miss_fraction}")
        if self.tokens_per_s_per_worker <= 0:
            raise ValueError("prefill signals: tokens_per_s_per_worker must be > 0 (one worker's prompt "
                             "tokens/s from the planner or cost model)")


@dataclass(frozen=True)
class DecodeSignals:
    """The decode pool now and over the last window.

    ``running``: sequences in the pool's decode batches; ``waiting``: requests and
    hand-offs waiting for a batch slot or KV room. ``kv_usage``: used / total KV
    blocks, averaged over ready workers (0..1). ``itl_p90_ms``: p90 of per-request
    mean inter-token latency of requests finished in the window (None: none did).
    ``seqs_per_worker``: sequences one worker holds (KV room at the workload's
    context length, capped by its batch size). ``kv_usage_by_worker``: each ready
    worker's used / total KV blocks, as each reports it (empty: not reported; then
    the mean alone speaks for KV room). The mean hides the full workers a hand-off
    waits on.
    """
    workers: int
    ready_workers: int
    running: int
    waiting: int
    kv_usage: float
    itl_p90_ms: float | None
    seqs_per_worker: float
    kv_usage_by_worker: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        _check_counts("decode", self.workers, self.ready_workers)
        if any(u < 0 for u in self.kv_usage_by_worker) or len(self.kv_usage_by_worker) > self.ready_workers:
            raise ValueError(f"decode signals: kv_usage_by_worker holds one used / total KV share (>= 0) per ready "
                             f"worker, got {len(self.kv_usage_by_worker)} for {self.ready_workers} ready workers")
        if self.running < 0 or self.waiting < 0 or self.kv_usage < 0:
            raise ValueError(f"decode signals: running, waiting and kv_usage must be >= 0, got {self}")
        if self.seqs_per_worker <= 0:
            raise ValueError("decode signals: seqs_per_worker must be > 0 (sequences one worker holds, "
                             "e.g. planner sequences_that_fit)")


@dataclass(frozen=True)
class FleetSignals:
    """Both pools, and ``draining``: workers of either pool out of the router but still
    finishing what they hold. They are in neither pool's ``workers`` yet still hold a GPU (and
    are paid for), so the fleet cap counts them: moving a worker from one pool to the other at
    the cap waits for the drain to end instead of paying for both."""
    prefill: PrefillSignals
    decode: DecodeSignals
    draining: int = 0

    def __post_init__(self) -> None:
        if self.draining < 0:
            raise ValueError(f"fleet signals: draining workers must be >= 0, got {self.draining}")


@dataclass(frozen=True)
class PoolBounds:
    min_workers: int
    max_workers: int

    def __post_init__(self) -> None:
        if self.min_workers < 1 or self.max_workers < self.min_workers:
            raise ValueError(f"pool bounds: need 1 <= min workers <= max workers, got {self.min_workers}.."
                             f"{self.max_workers} (--min-*-workers / --max-*-workers)")

    def clamp(self, n: int) -> int:
        return min(max(n, self.min_workers), self.max_workers)


@dataclass(frozen=True)
class AutoscaleConfig:
    """The operator's targets and the controller's tuning.

    Scale out when the predicted load needs more workers at ``target_utilization``,
    or when the pool's SLO p90 misses its target (by the miss, at most a step);
    scale in only when the load fits in fewer at ``scale_in_utilization`` (< target:
    the hysteresis band) and the SLO p90 is under ``slo_scale_in_margin`` of its
    target, for ``scale_in_hold_s`` in a row. After a scale-out, no
    further scale-out for ``cooldown_out_s`` (new workers are still starting);
    after any change, no scale-in for ``cooldown_in_s``. One decision moves a pool
    by at most ``max(1, ceil(workers * max_step_up))`` up or
    ``max(1, floor(workers * max_step_down))`` down.
    """
    slo_ttft_ms: float
    slo_itl_ms: float
    prefill: PoolBounds
    decode: PoolBounds
    max_total_workers: int | None = None   # both pools together (a fleet cap); None: none
    decode_first_under_cap: bool = False   # at the cap, decode's growth first (else shared by the asks)
    target_utilization: float = 0.8
    scale_in_utilization: float = 0.45
    queue_drain_fraction: float = 0.5      # drain the prefill queue within this part of the TTFT target
    # with PrefillSignals.ttft_wait_miss_fraction: the part of the requests that may miss TTFT by
    # waiting; above it prefill grows by ttft_miss_gain x the relative excess (at least one
    # worker, at most a step), and it shrinks only under slo_scale_in_margin x the budget
    ttft_miss_budget: float = 0.002
    ttft_miss_gain: float = 0.25
    slo_scale_in_margin: float = 0.7      # scale in only while the pool's SLO p90 is under this part of target
    capacity_recovery_per_s: float = 0.001  # learned capacity scale recovers toward 1 this fast (x per s)
    min_capacity_scale: float = 0.05
    target_kv_usage: float = 0.75
    ewma_alpha: float = 0.3                # weight of the newest observation
    trend_alpha: float = 0.3
    predict_ahead_s: float = 30.0          # forecast horizon (about a worker's start-up time)
    scale_in_hold_s: float = 60.0
    # prefill waits this many scale-in holds: its size is set by the TTFT tail (long prompts
    # queued behind each other), not by the token rate the scale-in test measures
    prefill_hold_factor: float = 5.0
    # no shrink below the most a pool needed at the scale-in level over this many holds
    scale_in_memory_factor: float = 3.0
    # decode's KV use (mean over workers) its scale-in counts as room: it fits in fewer workers
    # when their KV would stay under this
    scale_in_kv_usage: float = 0.6
    # prefill wants more at the fleet cap: decode shrinks without its hold (the memory still holds)
    trade_at_cap: bool = True
    # no prompt tokens arrived and none queued for this long: both pools drain to their minimum at
    # once (None: never; the caller's window adds to it, as the rate is over its window)
    idle_hold_s: float | None = 30.0
    cooldown_out_s: float = 30.0
    cooldown_in_s: float = 30.0
    max_step_up: float = 0.5
    max_step_down: float = 0.2
    # at the fleet cap decode grows by its load (sequences) and KV rules only past this share of
    # what it holds, not past target_utilization / target_kv_usage: there a decode worker more is a
    # prefill worker fewer (displaced, or not traded), so decode rides a burst nearly full, as a
    # fixed split does, instead of buying headroom with prefill's TTFT; the targets still size
    # its scale-in, its trades and the start split (None: the targets, at the cap too)
    decode_grow_usage_at_cap: float | None = 0.95

    def __post_init__(self) -> None:
        if self.slo_ttft_ms <= 0 or self.slo_itl_ms <= 0:
            raise ValueError("give positive SLOs, e.g. --slo-ttft-ms 2000 --slo-itl-ms 100")
        if not 0 < self.scale_in_utilization < self.target_utilization <= 1:
            raise ValueError("need 0 < scale_in_utilization < target_utilization <= 1 (the hysteresis band)")
        if not 0 < self.scale_in_kv_usage <= self.target_kv_usage:
            raise ValueError(f"need 0 < scale_in_kv_usage <= target_kv_usage ({self.target_kv_usage}), got "
                             f"{self.scale_in_kv_usage}")
        if self.prefill_hold_factor < 0 or self.scale_in_memory_factor < 0:
            raise ValueError("prefill_hold_factor and scale_in_memory_factor must be >= 0 (multiples of scale_in_hold_s)")
        if not 0 < self.queue_drain_fraction <= 1 or not 0 < self.target_kv_usage <= 1 \
                or not 0 < self.slo_scale_in_margin <= 1:
            raise ValueError("queue_drain_fraction, target_kv_usage and slo_scale_in_margin must be in (0, 1]")
        if not 0 < self.ewma_alpha <= 1 or not 0 <= self.trend_alpha <= 1:
            raise ValueError("ewma_alpha must be in (0, 1] and trend_alpha in [0, 1]")
        if not 0 < self.ttft_miss_budget < 1 or self.ttft_miss_gain <= 0:
            raise ValueError("ttft_miss_budget must be in (0, 1) and ttft_miss_gain > 0")
        if not 0 < self.min_capacity_scale <= 1:
            raise ValueError("min_capacity_scale must be in (0, 1]")
        for name in ("capacity_recovery_per_s", "predict_ahead_s", "scale_in_hold_s", "cooldown_out_s", "cooldown_in_s",
                     "max_step_up", "max_step_down"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.idle_hold_s is not None and self.idle_hold_s < 0:
            raise ValueError(f"idle_hold_s must be >= 0 seconds (or None: never), got {self.idle_hold_s}")
        grow = self.decode_grow_usage_at_cap
        if grow is not None and not max(self.target_utilization, self.target_kv_usage) <= grow <= 1:
            raise ValueError(f"decode_grow_usage_at_cap must be in [max(target_utilization, target_kv_usage), 1] "
                             f"= [{max(self.target_utilization, self.target_kv_usage)}, 1] (or None: the "
                             f"targets), got {grow}")
        if self.max_total_workers is not None and \
                self.max_total_workers < self.prefill.min_workers + self.decode.min_workers:
            raise ValueError(f"max_total_workers {self.max_total_workers} is below the pools' minimums "
                             f"({self.prefill.min_workers} + {self.decode.min_workers}): raise it or lower them")


def _check_counts(pool: str, workers: int, ready: int) -> None:
    if workers < 0 or not 0 <= ready <= workers:
        raise ValueError(f"{pool} signals: need 0 <= ready_workers <= workers, got {ready} of {workers}")

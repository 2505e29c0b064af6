"""Prefill:decode pool sizing from a request rate and per-node speeds.

    prefill demand (tokens/s) = request_rate * input_len
    decode demand  (tokens/s) = request_rate * output_len
    prefill nodes = ceil(prefill demand / per-node prefill tokens/s)
    decode nodes  = ceil(decode demand / per-node decode tokens/s)

Per-node decode tokens/s is the node's aggregate at its maximum concurrent
sequences (the batch the KV capacity allows), so decode nodes also hold
request_rate * output_len / decode_tps_per_seq sequences in flight (Little).
`measure_speeds` measures both speeds on this machine with pdserve's engine.
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class PoolPlan:
    request_rate: float
    input_len: int
    output_len: int
    prefill_tps: float
    decode_tps: float
    prefill_demand_tps: float
    decode_demand_tps: float
    prefill_nodes: int
    decode_nodes: int
    prefill_utilization: float    # demand / capacity of the sized pool
    decode_utilization: float
    speeds_source: str            # "given" | "measured"

    @property
    def ratio(self) -> str:
        return f"{self.prefill_nodes}:{self.decode_nodes}"


def size_pools(request_rate: float, input_len: int, output_len: int, prefill_tps: float,
               decode_tps: float, speeds_source: str = "given") -> PoolPlan:
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive requests/s, got {request_rate}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--input-len and --output-len must be >= 1 token, got {input_len} and {output_len}")
    if prefill_tps <= 0 or decode_tps <= 0:
        raise ValueError("--prefill-tps and --decode-tps must be positive tokens/s (or use --measure)")
    prefill_demand = request_rate * input_len
    decode_demand = request_rate * output_len
    prefill_nodes = max(1, math.ceil(prefill_demand / prefill_tps))
    decode_nodes = max(1, math.ceil(decode_demand / decode_tps))
    return PoolPlan(request_rate=request_rate, input_len=input_len, output_len=output_len,
                    prefill_tps=prefill_tps, decode_tps=decode_tps,
                    prefill_demand_tps=prefill_demand, decode_demand_tps=decode_demand,
                    prefill_nodes=prefill_nodes, decode_nodes=decode_nodes,
                    prefill_utilization=prefill_demand / (prefill_nodes * prefill_tps),
                    decode_utilization=decode_demand / (decode_nodes * decode_tps),
                    speeds_source=speeds_source)


@dataclass(frozen=True)
class MeasuredSpeeds:
    prefill_tps: float       # prompt tokens/s, a batch of prompts of input_len
    decode_tps: float        # generated tokens/s, aggregate over `concurrency` sequences
    concurrency: int
    input_len: int
    output_len: int


def _engine_llm_factory() -> Callable[..., object]:
    try:
        from engine import LLM
    except ImportError as e:
        raise ValueError("--measure runs pdserve's engine (engine.LLM) on this machine, and it is not "
                         f"available here ({e}); pass --prefill-tps and --decode-tps instead") from None
    return LLM


def measure_speeds(model_path: str, input_len: int, output_len: int, concurrency: int = 8,
                   llm_factory: Callable[..., object] | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> MeasuredSpeeds:
    """Prefill: `concurrency` distinct prompts of input_len with max_tokens=1.
    Decode: the same count generating output_len tokens; decode time is the
    run's time minus the prefill time measured just before."""
    if concurrency < 1 or input_len < 1 or output_len < 2:
        raise ValueError("--measure needs concurrency >= 1, --input-len >= 1 and --output-len >= 2")
    factory = llm_factory or _engine_llm_factory()
    from engine.sampling_params import SamplingParams
    llm = factory(model=model_path)
    llm.generate([_prompt(0, 8)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up

    prefill_s = _timed(llm, clock, [_prompt(i + 1, input_len) for i in range(concurrency)],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    run_s = _timed(llm, clock, [_prompt(i + 1 + concurrency, input_len) for i in range(concurrency)],
                   SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    decode_s = max(run_s - prefill_s, 1e-9)
    return MeasuredSpeeds(prefill_tps=concurrency * input_len / max(prefill_s, 1e-9),
                          decode_tps=concurrency * (output_len - 1) / decode_s,
                          concurrency=concurrency, input_len=input_len, output_len=output_len)


def _prompt(seed: int, length: int) -> list[int]:
    """Token ids that differ from the first token on, so no prompt hits another's prefix cache."""
    return [100 + (seed * 7919 + i * 31) % 1000 for i in range(length)]


def _timed(llm, clock: Callable[[], float], prompts, params) -> float:
    start = clock()
    llm.generate(prompts, params)
    return clock() - start


def peak_rate(arrivals_s: Sequence[float], window_s: float) -> float:
    """Requests/s over the busiest ``window_s`` seconds of the arrivals (a window starting at
    each arrival)."""
    if window_s <= 0:
        raise ValueError(f"the peak window must be positive seconds, got {window_s}")
    t = sorted(arrivals_s)
    return max((bisect.bisect_left(t, a + window_s) - i for i, a in enumerate(t)), default=0) / window_s


def split_at_cap(nodes: int, plan: PoolPlan, peak_request_rate: float, target_kv_usage: float) -> tuple[int, int]:
    """Prefill:decode of ``nodes`` workers when they are all there is (a fleet cap).

    Decode must hold the sequences in flight at the busiest moment: by Little's law that is
    the request rate times a sequence's decode lifetime, so at ``peak_request_rate`` (the
    busiest window of about one lifetime, `peak_rate`) the plan's decode nodes (sized at the
    mean rate, 100% of their KV) grow by peak / mean, and by 1 / ``target_kv_usage`` for the
    room the autoscaler keeps. Short of that the pool is at a cliff: hand-offs wait for room,
    time out and recompute on decode nodes. Prefill gets the rest: past its token rate
    (the plan's prefill nodes) every worker it gains shortens the queues behind long prompts,
    so the TTFT tail keeps falling, while decode beyond the sequences it holds buys nothing.
    Each pool gets at least one worker."""
    if nodes < 2:
        raise ValueError(f"a split needs at least 2 nodes (one per pool), got {nodes}")
    if peak_request_rate < plan.request_rate:
        raise ValueError(f"the peak request rate ({peak_request_rate}) is below the plan's mean "
                         f"({plan.request_rate}): give the rate of the busiest window "
                         "(pdserve plan --peak-request-rate)")
    if not 0 < target_kv_usage <= 1:
        raise ValueError(f"target_kv_usage is a share of KV, in (0, 1], got {target_kv_usage}")
    at_mean = plan.decode_demand_tps / plan.decode_tps
    decode = math.ceil(at_mean * peak_request_rate / plan.request_rate / target_kv_usage - 1e-9)
    decode = min(max(1, decode), nodes - 1)
    return nodes - decode, decode


@dataclass(frozen=True)
class CapSplit:
    """`split_at_cap` with what it used: the start split of a fleet capped at ``max_workers``."""
    max_workers: int
    prefill_workers: int
    decode_workers: int
    peak_request_rate: float      # requests/s of the busiest window the decode pool holds
    peak_factor: float            # peak_request_rate / the plan's mean rate
    target_kv_usage: float

    @property
    def ratio(self) -> str:
        return f"{self.prefill_workers}:{self.decode_workers}"


def cap_split(max_workers: int, plan: PoolPlan, peak_request_rate: float | None,
              target_kv_usage: float) -> CapSplit:
    """The split the autoscaler starts a fleet capped at ``max_workers`` with (`split_at_cap`);
    ``peak_request_rate`` None: the plan's mean rate (a factor of 1)."""
    peak = plan.request_rate if peak_request_rate is None else peak_request_rate
    prefill, decode = split_at_cap(max_workers, plan, peak, target_kv_usage)
    return CapSplit(max_workers, prefill, decode, peak, peak / plan.request_rate, target_kv_usage)

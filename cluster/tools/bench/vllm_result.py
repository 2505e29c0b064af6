"""A run as `vllm bench serve --save-result` writes it, for side-by-side comparison.

The keys and units are vLLM's for every figure both tools have: counts and
throughputs (`completed`, `failed`, `total_input_tokens`, `request_throughput`,
`output_throughput`, ...), per-request lists (`input_lens`, `output_lens`,
`ttfts` and `itls` in seconds, `start_times`, `errors`), and per metric
(ttft, tpot, itl, e2el) `mean_*_ms`, `median_*_ms`, `std_*_ms` and
`p{50,90,95,99}_*_ms` (numpy's mean, median, std and linear percentiles, as
vLLM computes them). `max_output_tokens_per_s` and `max_concurrent_requests`
are the most output chunks in a one-second bin and the peak of requests in
flight. Keys vLLM does not have are prefixed `pdserve_`.
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np

from cluster.tools.bench.runner import RequestResult, RunResult

PERCENTILES = (50, 90, 95, 99)


def vllm_result(run: RunResult, *, backend: str, model_id: str, tokenizer_id: str, num_prompts: int,
                request_rate: float, burstiness: float, max_concurrency: int, label: str = "",
                goodput: int | None = None) -> dict:
    rs = run.results
    done = [r for r in rs if r.ok]
    duration = run.elapsed_s
    per_s = (lambda x: x / duration if duration > 0 else 0.0)
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    out: dict = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": label or None,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": num_prompts,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "burstiness": burstiness,
        "max_concurrency": max_concurrency or None,
        "duration": duration,
        "completed": len(done),
        "failed": len(rs) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(done)),
        "request_goodput": None if goodput is None else per_s(goodput),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "input_lens": [r.prompt_tokens for r in rs],
        "output_lens": [r.output_tokens if r.ok else 0 for r in rs],
        "ttfts": [r.ttft_s or 0.0 for r in rs],
        "itls": [list(r.itl_s) for r in rs],
        "start_times": [r.sent_s for r in rs],
        "errors": [f"{r.error_code}: {r.error}" if r.error_code else "" for r in rs],
        "max_output_tokens_per_s": max_per_second(rs),
        "max_concurrent_requests": max_concurrent(rs),
        "pdserve_cached_tokens": sum(r.cached_tokens for r in done),
    }
    for name, values in (("ttft", [r.ttft_s for r in done]),
                         ("tpot", [r.tpot_s for r in done]),
                         ("itl", [g for r in done for g in r.itl_s]),
                         ("e2el", [r.e2e_s for r in done])):
        out.update(stats_ms(name, values))
    return out


def stats_ms(name: str, values_s: Sequence[float | None]) -> dict:
    """mean/median/std/pXX of `name` in milliseconds (0 when there are none, as vLLM writes)."""
    arr = np.array([v for v in values_s if v is not None], dtype=float) * 1000.0
    if not arr.size:
        arr = np.zeros(1)
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(arr, p)) for p in PERCENTILES})
    return out


def max_per_second(results: Sequence[RequestResult]) -> float:
    """Most output tokens (chunks, for HTTP streams) that arrived within one second-wide bin."""
    times = [t for r in results for t in r.token_times_s]
    if not times:
        return 0.0
    return float(np.bincount(np.floor(np.array(times)).astype(int)).max())


def max_concurrent(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once (from each request's send to its end)."""
    edges = []
    for r in results:
        end = r.sent_s + (r.e2e_s if r.e2e_s is not None else (r.token_times_s[-1] - r.sent_s
                                                                 if r.token_times_s else 0.0))
        edges += [(r.sent_s, 1), (end, -1)]
    live = peak = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):
        live += step
        peak = max(peak, live)
    return peak

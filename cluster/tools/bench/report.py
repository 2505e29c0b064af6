"""Turn per-request results into the benchmark summary (a JSON-able dict).

Latencies are in milliseconds: mean, p50, p90, p95, p99 (linear interpolation
between order statistics, numpy's default). Throughputs divide by the run's
elapsed time (first send -> last response) and count finished requests only.
Goodput counts finished requests that meet every SLO given; a request with
one output token has no TPOT and meets any TPOT SLO.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import numpy as np

from cluster.tools.bench.runner import INCOMPLETE, RequestResult, RunResult

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if v is not None and not v > 0:
                raise ValueError(f"--slo-{name.replace('_', '-')} must be > 0 milliseconds, got {v}")

    @property
    def given(self) -> bool:
        return any(v is not None for v in asdict(self).values())

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft_ms, r.ttft_s), (self.tpot_ms, r.tpot_s), (self.e2e_ms, r.e2e_s))
        return all(limit is None or value is None or value * 1000.0 <= limit for limit, value in checks)


def latency_stats(values_s: Iterable[float | None]) -> dict:
    """{count, mean, p50, p90, p95, p99} in ms of the non-None values (None fields when empty)."""
    arr = np.array([v for v in values_s if v is not None], dtype=float) * 1000.0
    out: dict = {"count": int(arr.size), "mean": float(arr.mean()) if arr.size else None}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def summarize(run: RunResult, slo: Slo = Slo(), meta: dict | None = None) -> dict:
    rs = run.results
    done = [r for r in rs if r.ok]
    elapsed = run.elapsed_s
    rate = (lambda x: x / elapsed if elapsed > 0 else 0.0)
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    codes = Counter(r.error_code for r in rs if not r.ok and r.error_code != INCOMPLETE)
    good = sum(1 for r in rs if slo.met(r)) if slo.given else None
    return {
        **(meta or {}),
        "requests": {"sent": len(rs), "finished": len(done), "failed": sum(codes.values()),
                     "incomplete": sum(1 for r in rs if r.error_code == INCOMPLETE), "not_sent": run.not_sent},
        "elapsed_s": elapsed,
        "request_throughput": rate(len(done)),
        "output_throughput": rate(output),
        "total_token_throughput": rate(prompt + output),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": cached,
        "prefix_cache_hit_rate": cached / prompt if prompt else 0.0,
        "ttft_ms": latency_stats(r.ttft_s for r in done),
        "tpot_ms": latency_stats(r.tpot_s for r in done),
        "itl_ms": latency_stats(g for r in done for g in r.itl_s),
        "e2e_ms": latency_stats(r.e2e_s for r in done),
        "cap_wait_ms": latency_stats(r.cap_wait_s for r in rs),
        "goodput": None if good is None else {
            "slo_ms": {k: v for k, v in asdict(slo).items() if v is not None},
            "requests": good, "request_rate": rate(good), "fraction": good / len(rs) if rs else 0.0},
        "failures": dict(sorted(codes.items())),
        "failure_examples": {c: next(r.error for r in rs if r.error_code == c) for c in sorted(codes)},
    }


def timeline(results: Sequence[RequestResult], elapsed_s: float, bin_s: float | None = None) -> dict:
    """Per time bin (default: about 40 bins, 0.1-1 s wide): output tokens/s, requests
    finished/s, mean TTFT and e2e (ms) of the requests finishing in the bin (None if none)."""
    if bin_s is None:
        bin_s = min(1.0, max(0.1, round(elapsed_s / 40, 1)))
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    bins = max(1, math.ceil(elapsed_s / bin_s))
    tokens = np.zeros(bins)
    finished = np.zeros(bins)
    ttft, e2e = [[] for _ in range(bins)], [[] for _ in range(bins)]
    idx = (lambda t: min(bins - 1, max(0, int(t // bin_s))))
    for r in results:
        for t in r.token_times_s:
            tokens[idx(t)] += 1
        if r.ok and r.e2e_s is not None:
            b = idx(r.sent_s + r.e2e_s)
            finished[b] += 1
            e2e[b].append(r.e2e_s * 1000.0)
            if r.ttft_s is not None:
                ttft[b].append(r.ttft_s * 1000.0)
    mean = (lambda xs: float(np.mean(xs)) if xs else None)
    return {"bin_s": bin_s, "t_s": [i * bin_s for i in range(bins)],
            "output_tok_s": (tokens / bin_s).tolist(), "requests_s": (finished / bin_s).tolist(),
            "ttft_ms_mean": [mean(x) for x in ttft], "e2e_ms_mean": [mean(x) for x in e2e]}


def format_table(s: dict) -> str:
    """A short human-readable view of a summary."""
    q = s["requests"]
    lines = [f"requests: {q['finished']} finished, {q['failed']} failed, {q['incomplete']} incomplete, "
             f"{q['not_sent']} not sent, in {s['elapsed_s']:.2f} s",
             f"throughput: {s['request_throughput']:.3f} req/s, {s['output_throughput']:.1f} output tok/s, "
             f"{s['total_token_throughput']:.1f} total tok/s",
             f"prefix cache hit rate: {s['prefix_cache_hit_rate']:.1%}"]
    fmt = (lambda v: "-" if v is None else f"{v:.1f}")
    lines.append(f"{'ms':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p95':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "cap_wait_ms"):
        st = s[key]
        cells = "".join(f"{fmt(st[k]):>10}" for k in ("mean", "p50", "p90", "p95", "p99"))
        lines.append(f"{key[:-3]:<10}{cells}")
    if s.get("goodput"):
        g = s["goodput"]
        lines.append(f"goodput: {g['requests']} requests ({g['fraction']:.1%}) meet {g['slo_ms']}, "
                     f"{g['request_rate']:.3f} req/s")
    if s["failures"]:
        lines.append(f"failures: {s['failures']}")
    return "\n".join(lines)

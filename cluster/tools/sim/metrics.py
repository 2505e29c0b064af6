"""What a simulation reports: per-request latencies, goodput under SLOs,
prefix hit rate in tokens, bytes moved, per-node utilisation.

TTFT is arrival -> first token (on the prefill node for a remote prefill,
as the real backend streams it from there). ITL is the gap between
consecutive tokens of a request as the client sees them, so the first gap
of a remote prefill includes the KV transfer and the decode join.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    kind: str = ""                   # remote_prefill | local_prefill
    prefill_node: str = ""
    decode_node: str = ""
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None
    tokens_out: int = 0
    cached_tokens: int = 0           # prompt tokens found in the cache where the prefill ran
    decode_cached_tokens: int = 0    # prompt tokens the decode node already held (not pulled)
    transferred_blocks: int = 0
    transferred_bytes: int = 0
    descriptors: int = 0
    preempted: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def mean_itl(self) -> float | None:
        if self.tokens_out < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.tokens_out - 1)


class LogHistogram:
    """Weighted histogram on log-spaced bins (10 us .. 1000 s, ~0.5% wide) for
    token-level ITL percentiles without keeping every sample."""

    def __init__(self, lo: float = 1e-5, hi: float = 1e3, bins: int = 4000, batch: int = 1 << 16) -> None:
        self.edges = np.geomspace(lo, hi, bins + 1)
        self._counts = np.zeros(bins + 2)
        self._total = 0.0
        self._n = 0.0
        # samples are binned in batches (one numpy pass per ~batch values, not per add)
        self._batch = batch
        self._values: list[np.ndarray] = []
        self._weights: list[float] = []
        self._pending = 0

    def add(self, values: np.ndarray | float, weight: float = 1.0) -> None:
        v = np.atleast_1d(np.asarray(values, dtype=float))
        self._values.append(v)
        self._weights.append(weight)
        self._pending += len(v)
        if self._pending >= self._batch:
            self._flush()

    def _flush(self) -> None:
        if not self._values:
            return
        v = np.concatenate(self._values)
        w = np.repeat(np.asarray(self._weights, dtype=float), [len(x) for x in self._values])
        idx = np.searchsorted(self.edges, v, side="right")
        self._counts += np.bincount(idx, weights=w, minlength=len(self._counts))
        self._total += float(np.dot(v, w))
        self._n += float(w.sum())
        self._values, self._weights, self._pending = [], [], 0

    @property
    def counts(self) -> np.ndarray:
        self._flush()
        return self._counts

    @property
    def total(self) -> float:
        self._flush()
        return self._total

    @property
    def n(self) -> float:
        self._flush()
        return self._n

    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    def quantile(self, q: float) -> float | None:
        if not self.n:
            return None
        c = np.cumsum(self.counts)
        i = int(np.searchsorted(c, q * self.n, side="left"))
        i = min(max(i, 1), len(self.edges) - 1)
        return float(np.sqrt(self.edges[i - 1] * self.edges[min(i, len(self.edges) - 1)]))


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    itl_s: float = 0.1

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError("SLOs are positive seconds, e.g. --slo-ttft 2 --slo-itl 0.1")


@dataclass
class NodeUsage:
    node_id: str
    role: str
    busy_s: float
    steps: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(xs)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def summarize(records: list[RequestRecord], itl_hist: LogHistogram, nodes: list[NodeUsage],
              duration_s: float, slo: Slo, extra: dict | None = None) -> dict:
    done = [r for r in records if r.finish_s is not None]
    ttft = [r.ttft for r in done]
    itl_req = [x for r in done if (x := r.mean_itl) is not None]
    good = [r for r in done if r.ttft <= slo.ttft_s and (r.mean_itl is None or r.mean_itl <= slo.itl_s)]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    kinds: dict[str, int] = {}
    for r in done:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    util = {}
    for role in sorted({n.role for n in nodes}):
        busy = [n.busy_s / duration_s if duration_s > 0 else 0.0 for n in nodes if n.role == role]
        util[role] = {"nodes": len(busy), "mean": float(np.mean(busy)), "max": float(np.max(busy)),
                      "min": float(np.min(busy))}
    out = {
        "requests": len(records), "finished": len(done), "duration_s": duration_s,
        "ttft_s": _stats(ttft),
        "itl_s": {"mean": itl_hist.mean(), "p50": itl_hist.quantile(0.5), "p90": itl_hist.quantile(0.9),
                  "p99": itl_hist.quantile(0.99), "per_request_mean": _stats(itl_req)["mean"]},
        "e2e_s": _stats([r.e2e for r in done]),
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
        "goodput": {"requests": len(good), "fraction": len(good) / len(done) if done else 0.0,
                    "requests_per_s": len(good) / duration_s if duration_s > 0 else 0.0},
        "throughput": {"requests_per_s": len(done) / duration_s if duration_s > 0 else 0.0,
                       "output_tokens_per_s": sum(r.tokens_out for r in done) / duration_s
                       if duration_s > 0 else 0.0},
        "hit_rate_tokens": cached / prompt if prompt else 0.0,
        "decode_hit_rate_tokens": sum(r.decode_cached_tokens for r in done if r.kind == "remote_prefill")
        / max(1, sum(r.prompt_tokens for r in done if r.kind == "remote_prefill")),
        "transfer": {"bytes": sum(r.transferred_bytes for r in done),
                     "blocks": sum(r.transferred_blocks for r in done),
                     "descriptors": sum(r.descriptors for r in done)},
        "decisions": kinds,
        "preemptions": sum(r.preempted for r in done),
        "utilisation": util,
    }
    out.update(extra or {})
    return out

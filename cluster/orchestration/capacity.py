"""What one worker can take, for the autoscaler, and latency percentiles over an interval.

Capacity is the operator's figure when given (`autoscale_prefill_tokens_per_s`,
`autoscale_decode_seqs_per_worker`; `pdserve plan` gives the sequences that fit a worker and
`pdserve plan --measure` a prefill rate on this host) or measured from the workers' reports:

- a prefill worker's prompt tokens/s: the prompt tokens it computed (queried
  minus prefix hits) per second, over intervals when it had prompts queued (it
  was busy the whole time, so that is what it sustains), smoothed; before any
  such interval, the fastest rate seen, and at least one full chunk
  (`max_num_batched_tokens`) per second;
- a decode worker's sequences: its KV blocks over the blocks its running
  sequences hold on average, capped by `max_num_seqs`.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.config import ServeConfig
from cluster.orchestration.pool import WorkerPool

SMOOTHING = 0.3


@dataclass
class _Seen:
    t: float
    computed: int            # prompt tokens computed so far (queried - prefix hits)


class CapacityEstimate:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self._seen: dict[str, _Seen] = {}
        self._busy_rate: float | None = None     # smoothed tokens/s of a busy prefill worker
        self._max_rate = float(config.max_num_batched_tokens)
        self._seqs = float(config.max_num_seqs)

    def observe(self, pool: WorkerPool, now: float) -> None:
        for worker_id, s in list(pool.stats.items()):
            if s.pool == "prefill":
                self._observe_prefill(worker_id, s, now)
        blocks = [(s.kv_blocks_total, s.kv_blocks_used / s.running) for s in pool.stats.values()
                  if s.pool != "prefill" and s.running > 0 and s.kv_blocks_used > 0]
        if blocks:
            fit = sum(total / per_seq for total, per_seq in blocks) / len(blocks)
            self._seqs = max(1.0, min(float(self.config.max_num_seqs), fit))

    def _observe_prefill(self, worker_id: str, s, now: float) -> None:
        computed = s.prefix_queried_tokens - s.prefix_hit_tokens
        last = self._seen.get(worker_id)
        self._seen[worker_id] = _Seen(now, computed)
        if last is None or now <= last.t or computed < last.computed:
            return
        rate = (computed - last.computed) / (now - last.t)
        self._max_rate = max(self._max_rate, rate)
        if s.waiting > 0 and rate > 0:   # queued the whole interval (as far as reports tell): its capacity
            self._busy_rate = rate if self._busy_rate is None else \
                SMOOTHING * rate + (1 - SMOOTHING) * self._busy_rate

    def prefill_tokens_per_s(self) -> float:
        if self.config.autoscale_prefill_tokens_per_s > 0:
            return self.config.autoscale_prefill_tokens_per_s
        return self._busy_rate if self._busy_rate is not None else self._max_rate

    def decode_seqs(self) -> float:
        if self.config.autoscale_decode_seqs_per_worker > 0:
            return float(self.config.autoscale_decode_seqs_per_worker)
        return self._seqs


class HistogramWindow:
    """Quantiles of what a Prometheus histogram observed since the previous call."""

    def __init__(self, histogram) -> None:
        self.histogram = histogram
        self._last: list[tuple[float, float]] = self._buckets()

    def _buckets(self) -> list[tuple[float, float]]:
        """(upper bound, cumulative count) per bucket, +Inf last."""
        out = []
        for family in self.histogram.collect():
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    out.append((float(sample.labels["le"]), sample.value))
        return sorted(out)

    def quantile(self, q: float) -> float | None:
        """The q-quantile of the observations since the last call (linear within a bucket;
        the last finite bound for the +Inf bucket); None when there were none."""
        now = self._buckets()
        last = dict(self._last)
        self._last = now
        counts = [(le, n - last.get(le, 0.0)) for le, n in now]
        total = counts[-1][1] if counts else 0.0
        if total <= 0:
            return None
        rank, lower, below = q * total, 0.0, 0.0
        for le, cum in counts:
            if cum >= rank:
                if le == float("inf"):
                    return lower
                inside = cum - below
                return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
            lower, below = le, cum
        return lower

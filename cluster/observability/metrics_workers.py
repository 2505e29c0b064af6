"""Per-worker Prometheus series, exported from the workers' latest reports.

The frontend pulls a `WorkerStats` from every worker once per stats interval
(cluster/orchestration/pool.py) and hands it to `WorkerSeries.observe`. A scrape then
turns the latest report of each live worker into families labelled
`worker` and `pool`: occupancy as gauges, and what the worker counts since it
started (prefix-cache lookups, lease expiries, preemptions, tier movements)
as counters, named `*_total`. A worker that restarts starts its counters from
zero again, which Prometheus' rate() and increase() read as a counter reset.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

TIERS = ("device", "host", "disk")
PREEMPTION_MODES = ("swap", "recompute")
LABELS = ("worker", "pool")


@dataclass(frozen=True)
class TierStats:
    """A worker's KV tiers (engine/tiers/): occupancy now, movements cumulative."""
    host_blocks_used: int = 0
    host_blocks_total: int = 0
    disk_blocks_used: int = 0
    disk_blocks_total: int = 0
    page_ins: int = 0              # cached blocks paged back into the device on a prefix hit
    page_outs: int = 0             # cached blocks moved down a tier
    bytes_moved: int = 0           # between tiers, swaps included
    swap_preemptions: int = 0
    recompute_preemptions: int = 0

    @classmethod
    def from_engine(cls, s) -> "TierStats":
        """From an engine.llm_engine.EngineStats."""
        return cls(s.kv_host_blocks_used, s.kv_host_blocks_total, s.kv_disk_blocks_used,
                   s.kv_disk_blocks_total, s.kv_page_ins, s.kv_page_outs, s.kv_bytes_moved,
                   s.swap_preemptions, s.recompute_preemptions)


@dataclass
class WorkerStats:
    """What a worker reports about itself (one Ray call per stats interval)."""
    worker_id: str
    pool: str                      # "prefill" | "decode" | "colocated"
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queried_tokens: int     # cumulative
    prefix_hit_tokens: int         # cumulative
    lease_expiries: int = 0        # cumulative
    leases_active: int = 0
    preemptions: int = 0           # cumulative
    tiers: TierStats = field(default_factory=TierStats)
    prefix_waits: int = 0          # cumulative: requests that waited for an in-flight prefix
    prefix_wait_blocks_saved: int = 0   # cumulative: in-flight blocks those took as hits
    reservation_expiries: int = 0  # cumulative (decode): reserved blocks no submit claimed in time


@dataclass(frozen=True)
class _Series:
    name: str
    doc: str
    value: Callable[[WorkerStats], float]


# (name, help, value): one sample per worker
GAUGES = (
    _Series("pdserve_requests_running", "Running requests per worker", lambda s: s.running),
    _Series("pdserve_requests_waiting", "Waiting requests per worker", lambda s: s.waiting),
    _Series("pdserve_kv_blocks_used", "KV blocks in use per worker", lambda s: s.kv_blocks_used),
    _Series("pdserve_kv_blocks_capacity", "KV blocks per worker", lambda s: s.kv_blocks_total),
    _Series("pdserve_kv_usage_ratio", "KV block usage per worker (0-1)",
            lambda s: s.kv_blocks_used / max(1, s.kv_blocks_total)),
    _Series("pdserve_leases_active", "KV leases held per worker", lambda s: s.leases_active),
)
COUNTERS = (   # exported as NAME_total
    _Series("pdserve_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache per worker",
            lambda s: s.prefix_queried_tokens),
    _Series("pdserve_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache per worker",
            lambda s: s.prefix_hit_tokens),
    _Series("pdserve_prefix_waits", "Requests that waited for prompt blocks another request was computing, "
            "instead of recomputing them, per worker", lambda s: s.prefix_waits),
    _Series("pdserve_prefix_wait_blocks_saved", "KV blocks taken as prefix hits after waiting for them "
            "(not recomputed) per worker", lambda s: s.prefix_wait_blocks_saved),
    _Series("pdserve_lease_expiries", "KV leases that expired unread per worker", lambda s: s.lease_expiries),
    _Series("pdserve_decode_reservation_expiries", "Decode KV reservations no submit claimed in time (their "
            "frontend gone), freed by the decode worker, per worker", lambda s: s.reservation_expiries),
    _Series("pdserve_preemptions", "Preemptions per worker", lambda s: s.preemptions),
    _Series("pdserve_kv_page_ins", "Cached KV blocks paged back into the device from host or disk per worker",
            lambda s: s.tiers.page_ins),
    _Series("pdserve_kv_page_outs", "Cached KV blocks moved down a tier instead of being dropped per worker",
            lambda s: s.tiers.page_outs),
    _Series("pdserve_kv_tier_bytes_moved", "Bytes moved between KV tiers per worker, swaps included",
            lambda s: s.tiers.bytes_moved),
)


def tier_blocks(s: WorkerStats) -> tuple[tuple[str, int, int], ...]:
    """(tier, used, total) of a worker's device, host and disk tiers."""
    t = s.tiers
    return (("device", s.kv_blocks_used, s.kv_blocks_total),
            ("host", t.host_blocks_used, t.host_blocks_total),
            ("disk", t.disk_blocks_used, t.disk_blocks_total))


class WorkerSeries:
    """A prometheus_client collector over the latest report of each worker.

    `observe` runs on the frontend's event loop, `collect` on the scrape's thread:
    the reports are swapped under a lock and read from a copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, WorkerStats] = {}

    def observe(self, s: WorkerStats) -> None:
        with self._lock:
            self._stats[s.worker_id] = s

    def forget(self, worker_id: str) -> None:
        with self._lock:
            self._stats.pop(worker_id, None)

    def snapshot(self) -> list[WorkerStats]:
        with self._lock:
            return sorted(self._stats.values(), key=lambda s: s.worker_id)

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot()
        for series in GAUGES:
            g = GaugeMetricFamily(series.name, series.doc, labels=LABELS)
            for s in stats:
                g.add_metric([s.worker_id, s.pool], series.value(s))
            yield g
        for series in COUNTERS:
            c = CounterMetricFamily(series.name, series.doc, labels=LABELS)
            for s in stats:
                c.add_metric([s.worker_id, s.pool], series.value(s))
            yield c
        used = GaugeMetricFamily("pdserve_kv_tier_blocks_used", "KV blocks held per tier (device, host, disk) "
                                 "per worker", labels=LABELS + ("tier",))
        total = GaugeMetricFamily("pdserve_kv_tier_blocks_capacity", "KV block capacity per tier per worker",
                                  labels=LABELS + ("tier",))
        for s in stats:
            for tier, u, t in tier_blocks(s):
                used.add_metric([s.worker_id, s.pool, tier], u)
                total.add_metric([s.worker_id, s.pool, tier], t)
        yield used
        yield total
        modes = CounterMetricFamily("pdserve_preemptions_by_mode", "Preemptions by swap or by recompute per "
                                    "worker", labels=LABELS + ("mode",))
        for s in stats:
            modes.add_metric([s.worker_id, s.pool, "swap"], s.tiers.swap_preemptions)
            modes.add_metric([s.worker_id, s.pool, "recompute"], s.tiers.recompute_preemptions)
        yield modes

"""Prometheus metrics of a pdserve deployment, all prefixed `pdserve_`.

One `Metrics` object per process owns its own CollectorRegistry (no global
registry). Per-worker figures (running / waiting requests, KV usage, prefix
cache and lease counters) are pulled from the worker actors by the frontend
once per `stats_interval` and exported here with `worker` and `pool` labels,
so a single scrape of the frontend's metrics port sees the whole cluster.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
BYTES_BUCKETS = tuple(float(2 ** i) for i in range(10, 34, 2))


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


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        H, C, G = Histogram, Counter, Gauge
        self.ttft = H("pdserve_time_to_first_token_seconds", "Time to first token", registry=r,
                      buckets=LATENCY_BUCKETS)
        self.itl = H("pdserve_inter_token_latency_seconds", "Gap between streamed tokens", registry=r,
                     buckets=LATENCY_BUCKETS)
        self.e2e = H("pdserve_e2e_request_latency_seconds", "End-to-end request latency", registry=r,
                     buckets=LATENCY_BUCKETS)
        self.queue_time = H("pdserve_queue_time_seconds", "Time from arrival to first scheduling",
                            registry=r, buckets=LATENCY_BUCKETS)
        self.transfer_seconds = H("pdserve_kv_transfer_seconds", "KV transfer duration", registry=r,
                                  buckets=LATENCY_BUCKETS)
        self.transfer_bytes = H("pdserve_kv_transfer_bytes", "KV bytes moved per transfer", registry=r,
                                buckets=BYTES_BUCKETS)
        self.transfer_blocks = C("pdserve_kv_transfer_blocks", "KV blocks moved between nodes",
                                 registry=r)
        self.requests = C("pdserve_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = C("pdserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = C("pdserve_generation_tokens", "Tokens generated", registry=r)
        self.routing = C("pdserve_routing_decisions", "Routing decisions by kind", ["kind"], registry=r)
        self.migrations = C("pdserve_request_migrations", "Requests moved to another decode worker "
                            "after theirs died", registry=r)
        self.transfer_failures = C("pdserve_transfer_failures", "KV transfers that failed", registry=r)
        self.frontend_queue = G("pdserve_frontend_queue_depth", "Requests admitted and not finished",
                                registry=r)
        labels = ["worker", "pool"]
        self.running = G("pdserve_requests_running", "Running requests per worker", labels, registry=r)
        self.waiting = G("pdserve_requests_waiting", "Waiting requests per worker", labels, registry=r)
        self.kv_used = G("pdserve_kv_blocks_used", "KV blocks in use per worker", labels, registry=r)
        self.kv_total = G("pdserve_kv_blocks_total", "KV blocks per worker", labels, registry=r)
        self.kv_usage = G("pdserve_kv_usage_ratio", "KV block usage per worker (0-1)", labels, registry=r)
        self.prefix_queried = G("pdserve_prefix_cache_queried_tokens", "Prompt tokens looked up in the "
                                "prefix cache (cumulative, per worker)", labels, registry=r)
        self.prefix_hit = G("pdserve_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache "
                            "(cumulative, per worker)", labels, registry=r)
        self.lease_expiries = G("pdserve_lease_expiries", "KV leases that expired unread (cumulative, "
                                "per worker)", labels, registry=r)
        self.leases_active = G("pdserve_leases_active", "KV leases held per worker", labels, registry=r)
        self.preemptions = G("pdserve_preemptions", "Preemptions (cumulative, per worker)", labels,
                             registry=r)

    def observe_worker(self, s: WorkerStats) -> None:
        lbl = dict(worker=s.worker_id, pool=s.pool)
        self.running.labels(**lbl).set(s.running)
        self.waiting.labels(**lbl).set(s.waiting)
        self.kv_used.labels(**lbl).set(s.kv_blocks_used)
        self.kv_total.labels(**lbl).set(s.kv_blocks_total)
        self.kv_usage.labels(**lbl).set(s.kv_blocks_used / max(1, s.kv_blocks_total))
        self.prefix_queried.labels(**lbl).set(s.prefix_queried_tokens)
        self.prefix_hit.labels(**lbl).set(s.prefix_hit_tokens)
        self.lease_expiries.labels(**lbl).set(s.lease_expiries)
        self.leases_active.labels(**lbl).set(s.leases_active)
        self.preemptions.labels(**lbl).set(s.preemptions)

    def forget_worker(self, worker_id: str, pool: str) -> None:
        for g in (self.running, self.waiting, self.kv_used, self.kv_total, self.kv_usage,
                  self.prefix_queried, self.prefix_hit, self.lease_expiries, self.leases_active,
                  self.preemptions):
            try:
                g.remove(worker_id, pool)
            except KeyError:
                pass

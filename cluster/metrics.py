"""Prometheus metrics of a pdserve deployment, all prefixed `pdserve_`.

One `Metrics` object per process owns its own CollectorRegistry (no global
registry). Per-worker figures (running / waiting requests, KV usage, prefix
cache and lease counters) are pulled from the worker actors by the frontend
once per `stats_interval` and exported here with `worker` and `pool` labels,
so a single scrape of the frontend's metrics port sees the whole cluster.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
BYTES_BUCKETS = tuple(float(2 ** i) for i in range(10, 34, 2))


TIERS = ("device", "host", "disk")
PREEMPTION_MODES = ("swap", "recompute")


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
        self.handoff = H("pdserve_handoff_seconds", "The gap between a request's first token (the prefill "
                         "node's) and its second (the decode node's), by stage: join (the decode node's "
                         "submit: KV room + pull), room (waiting for KV blocks), pull (the KV read), "
                         "first_step (joined to the second token at the frontend), total", ["stage"],
                         registry=r, buckets=LATENCY_BUCKETS)
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

        tier_labels = labels + ["tier"]
        self.tier_blocks_used = G("pdserve_kv_tier_blocks_used", "KV blocks held per tier (device, host, "
                                  "disk) per worker", tier_labels, registry=r)
        self.tier_blocks_total = G("pdserve_kv_tier_blocks_total", "KV block capacity per tier per worker",
                                   tier_labels, registry=r)
        self.page_ins = G("pdserve_kv_page_ins", "Cached KV blocks paged back into the device from host or "
                          "disk (cumulative, per worker)", labels, registry=r)
        self.page_outs = G("pdserve_kv_page_outs", "Cached KV blocks moved down a tier instead of being "
                           "dropped (cumulative, per worker)", labels, registry=r)
        self.tier_bytes = G("pdserve_kv_tier_bytes_moved", "Bytes moved between KV tiers, swaps included "
                            "(cumulative, per worker)", labels, registry=r)
        self.preemptions_by_mode = G("pdserve_preemptions_by_mode", "Preemptions by swap or by recompute "
                                     "(cumulative, per worker)", labels + ["mode"], registry=r)

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
        t = s.tiers
        for tier, used, total in (("device", s.kv_blocks_used, s.kv_blocks_total),
                                  ("host", t.host_blocks_used, t.host_blocks_total),
                                  ("disk", t.disk_blocks_used, t.disk_blocks_total)):
            self.tier_blocks_used.labels(**lbl, tier=tier).set(used)
            self.tier_blocks_total.labels(**lbl, tier=tier).set(total)
        self.page_ins.labels(**lbl).set(t.page_ins)
        self.page_outs.labels(**lbl).set(t.page_outs)
        self.tier_bytes.labels(**lbl).set(t.bytes_moved)
        self.preemptions_by_mode.labels(**lbl, mode="swap").set(t.swap_preemptions)
        self.preemptions_by_mode.labels(**lbl, mode="recompute").set(t.recompute_preemptions)

    def forget_worker(self, worker_id: str, pool: str) -> None:
        for g in (self.running, self.waiting, self.kv_used, self.kv_total, self.kv_usage,
                  self.prefix_queried, self.prefix_hit, self.lease_expiries, self.leases_active,
                  self.preemptions, self.page_ins, self.page_outs, self.tier_bytes):
            try:
                g.remove(worker_id, pool)
            except KeyError:
                pass
        for g, extra in ((self.tier_blocks_used, TIERS), (self.tier_blocks_total, TIERS),
                         (self.preemptions_by_mode, PREEMPTION_MODES)):
            for value in extra:
                try:
                    g.remove(worker_id, pool, value)
                except KeyError:
                    pass

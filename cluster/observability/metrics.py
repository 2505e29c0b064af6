"""Prometheus metrics of a pdserve deployment, all prefixed `pdserve_`.

One `Metrics` object per process owns its own CollectorRegistry (no global
registry). Per-worker figures (running / waiting requests, KV usage, prefix
cache and lease counters) are pulled from the worker actors by the frontend
once per `stats_interval` and exported here with `worker` and `pool` labels,
so a single scrape of the frontend's metrics port sees the whole cluster
(cluster/observability/metrics_workers.py: gauges for occupancy, `*_total` counters for what
a worker counts). Cumulative figures are counters, exported as `*_total`.
`export_vllm_names` adds the vLLM-named series Kubernetes inference gateways
read (cluster/observability/metrics_vllm.py).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cluster.observability.metrics_vllm import VllmNames
from cluster.observability.metrics_workers import PREEMPTION_MODES, TIERS, TierStats, WorkerSeries, WorkerStats

__all__ = ["Metrics", "TierStats", "WorkerStats", "TIERS", "PREEMPTION_MODES", "LATENCY_BUCKETS",
           "RESERVATION_OUTCOMES"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
RESERVATION_OUTCOMES = ("reserved", "refused", "failed", "skipped_backlog")
BYTES_BUCKETS = tuple(float(2 ** i) for i in range(10, 34, 2))


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
                         "submit: KV room + pull), room (waiting for KV blocks), pull (the KV read), admit (the "
                         "decode node reported it in its batch), hold (the first token held for that: "
                         "first_token_release=decode), first_step (joined to the second token at the "
                         "frontend), client_gap (first token released to the second), total", ["stage"],
                         registry=r, buckets=LATENCY_BUCKETS)
        self.requests = C("pdserve_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = C("pdserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = C("pdserve_generation_tokens", "Tokens generated", registry=r)
        self.routing = C("pdserve_routing_decisions", "Routing decisions by kind", ["kind"], registry=r)
        self.migrations = C("pdserve_request_migrations", "Requests moved to another decode worker "
                            "after theirs died", registry=r)
        self.decode_rebalanced = C("pdserve_decode_rebalanced", "Hand-offs that waited for a batch slot on one "
                                   "decode worker and moved to one with free slots", registry=r)
        self.decode_reservations = _decode_reservations(r)
        self.transfer_failures = C("pdserve_transfer_failures", "KV transfers that failed", registry=r)
        self.frontend_queue = G("pdserve_frontend_queue_depth", "Requests admitted and not finished",
                                registry=r)
        self.prefill_gate_held, self.prefill_gate_wait = _prefill_gate(r)
        self.pool_workers, self.pool_target_workers, self.autoscale_decisions, self.ttft_wait_miss = _pools(r)
        self.workers = WorkerSeries()
        r.register(self.workers)
        self._vllm: VllmNames | None = None

    def count_decode_reservation(self, outcome: str) -> None:
        """One hand-off's decode reservation outcome (RESERVATION_OUTCOMES)."""
        if outcome not in RESERVATION_OUTCOMES:
            raise ValueError(f"unknown decode reservation outcome {outcome!r}: use one of {RESERVATION_OUTCOMES}")
        self.decode_reservations.labels(outcome=outcome).inc()

    def export_vllm_names(self, model_name: str, block_size: int) -> None:
        """Also export the vllm:* series gateways read (cluster/observability/metrics_vllm.py), labelled model_name."""
        if self._vllm is not None:
            self.registry.unregister(self._vllm)
        self._vllm = VllmNames(self, model_name, block_size)
        self.registry.register(self._vllm)

    def observe_worker(self, s: WorkerStats) -> None:
        self.workers.observe(s)

    def forget_worker(self, worker_id: str, pool: str) -> None:
        self.workers.forget(worker_id)


def _pools(r: CollectorRegistry) -> tuple[Gauge, Gauge, Counter, Gauge]:
    """The pools' sizes and the autoscaler's series."""
    return (Gauge("pdserve_pool_workers", "Workers serving in each pool (ready and routed)", ["pool"], registry=r),
            Gauge("pdserve_pool_target_workers", "Workers the autoscaler wants in each pool (the configured "
                  "size without --autoscale)", ["pool"], registry=r),
            Counter("pdserve_autoscale_decisions", "Autoscaling decisions by pool, direction (up, down, hold) "
                    "and reason", ["pool", "direction", "reason"], registry=r),
            Gauge("pdserve_autoscale_ttft_wait_miss_fraction", "Of the requests whose prefill alone fits the "
                  "TTFT target, the part that missed it by waiting, over the autoscaler's window (NaN: none "
                  "counted; --autoscale)", registry=r))


def _prefill_gate(r: CollectorRegistry) -> tuple[Gauge, Histogram]:
    """The prefill gate's series (prefill_queue_limit; cluster/orchestration/prefill_gate.py)."""
    held = Gauge("pdserve_prefill_gate_held", "Requests the prefill gate holds at the frontend while every "
                 "prefill node is busy (prefill_queue_limit)", registry=r)
    wait = Histogram("pdserve_prefill_gate_wait_seconds", "Time a request was held by the prefill gate before "
                     "it was routed (0 when it was not)", registry=r,
                     buckets=(0.0, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
    return held, wait


def _decode_reservations(r: CollectorRegistry) -> Counter:
    """pdserve_decode_reservations_total{outcome}, every outcome exported from the start (at 0)."""
    c = Counter("pdserve_decode_reservations", "Hand-offs whose decode KV blocks the frontend asked to reserve "
                "at routing, by outcome: reserved, refused (the decode node had no room, a full queue or was "
                "draining), failed (the call failed), skipped_backlog (not asked: the prefill node had a step's "
                "tokens or more queued ahead)", ["outcome"], registry=r)
    for outcome in RESERVATION_OUTCOMES:
        c.labels(outcome=outcome)
    return c

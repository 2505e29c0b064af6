"""The live autoscaler's measurements (cluster/orchestration/capacity.py): worker capacity
from reports, and latency quantiles over one interval from a Prometheus histogram."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Histogram

from cluster.config import ServeConfig
from cluster.observability.metrics_workers import WorkerStats
from cluster.orchestration.capacity import CapacityEstimate, HistogramWindow


def stats(worker_id, pool, *, running=0, waiting=0, used=0, total=100, queried=0, hits=0) -> WorkerStats:
    return WorkerStats(worker_id, pool, running, waiting, used, total, queried, hits)


def pool_of(*reports) -> SimpleNamespace:
    return SimpleNamespace(stats={s.worker_id: s for s in reports})


def test_operator_figures_win_over_measurements():
    est = CapacityEstimate(ServeConfig(autoscale_prefill_tokens_per_s=900, autoscale_decode_seqs_per_worker=7))
    est.observe(pool_of(stats("decode-0", "decode", running=2, used=50)), 0.0)
    assert est.prefill_tokens_per_s() == 900 and est.decode_seqs() == 7


def test_prefill_capacity_is_the_rate_of_a_busy_worker_not_of_an_idle_one():
    est = CapacityEstimate(ServeConfig(max_num_batched_tokens=512))
    assert est.prefill_tokens_per_s() == 512             # nothing seen yet: one chunk a second
    est.observe(pool_of(stats("prefill-0", "prefill", queried=0)), 0.0)
    est.observe(pool_of(stats("prefill-0", "prefill", queried=1000, hits=0)), 1.0)   # idle: 1000/s
    assert est.prefill_tokens_per_s() == 1000            # the fastest seen, until one was busy
    est.observe(pool_of(stats("prefill-0", "prefill", queried=4000, hits=500, waiting=3)), 2.0)  # busy: 2500/s
    assert est.prefill_tokens_per_s() == pytest.approx(2500)
    est.observe(pool_of(stats("prefill-0", "prefill", queried=7000, hits=500, waiting=1)), 3.0)  # busy: 3000/s
    assert est.prefill_tokens_per_s() == pytest.approx(0.3 * 3000 + 0.7 * 2500)


def test_decode_capacity_is_kv_room_over_blocks_per_sequence_capped_by_max_num_seqs():
    est = CapacityEstimate(ServeConfig(max_num_seqs=64))
    assert est.decode_seqs() == 64
    est.observe(pool_of(stats("decode-0", "decode", running=4, used=40, total=100)), 0.0)   # 10 blocks a sequence
    assert est.decode_seqs() == pytest.approx(10)
    est.observe(pool_of(stats("decode-0", "decode", running=4, used=4, total=1000)), 1.0)   # 1000 fit: capped
    assert est.decode_seqs() == 64


def test_histogram_window_sees_only_the_interval():
    h = Histogram("x_seconds", "x", registry=CollectorRegistry(), buckets=(0.1, 0.2, 0.4, 0.8))
    for v in [0.05] * 100:
        h.observe(v)
    w = HistogramWindow(h)          # starts from what was observed before it
    assert w.quantile(0.9) is None
    for v in [0.3] * 9 + [0.7]:
        h.observe(v)
    q = w.quantile(0.9)
    assert 0.2 < q <= 0.4            # the interval's p90 is in (0.2, 0.4], not the old 0.05s
    assert w.quantile(0.9) is None   # nothing new since
    h.observe(5.0)
    assert w.quantile(0.5) == 0.8    # +Inf bucket: the last finite bound


def test_live_signals_age_the_last_prompt_from_the_prompt_token_counter():
    """The live head gives the controller `since_last_prompt_s` (the lull rule counts from the
    last prompt, as in the simulator): zero in an interval with new prompt tokens, then the
    time since that interval; None before any prompt."""
    from cluster.observability.metrics import Metrics
    from cluster.orchestration.autoscaler import Autoscaler

    now = [0.0]
    pool = SimpleNamespace(router=SimpleNamespace(view=SimpleNamespace(prefill=[], decode=[])),
                           serving=lambda pool: [f"{pool}-0"],
                           held=lambda pool: [f"{pool}-0"], stats={})
    metrics = Metrics()
    scaler = Autoscaler(SimpleNamespace(pool=pool), ServeConfig(autoscale=True), metrics, clock=lambda: now[0])

    def age(t: float) -> float | None:
        now[0] = t
        return scaler._signals(t).prefill.since_last_prompt_s

    assert age(0.0) is None                      # nothing yet
    metrics.prompt_tokens.inc(300)
    assert age(5.0) == 0.0                       # prompts in (0, 5]
    assert age(10.0) == 5.0 and age(15.0) == 10.0
    metrics.prompt_tokens.inc(10)
    assert age(20.0) == 0.0


def test_live_signals_give_each_decode_workers_own_kv_use():
    """The live head gives the controller each decode worker's KV use as the router's view has
    it from that worker's report (the mean hides the full worker a hand-off waits on)."""
    from cluster.observability.metrics import Metrics
    from cluster.orchestration.autoscaler import Autoscaler
    from cluster.router import WorkerLoad

    views = [SimpleNamespace(worker_id=f"decode-{i}", load=WorkerLoad(0, r, w, kv))
             for i, (r, w, kv) in enumerate([(3, 0, 0.2), (9, 4, 0.9)])]
    pool = SimpleNamespace(router=SimpleNamespace(view=SimpleNamespace(prefill=[], decode=views)),
                           serving=lambda pool: [v.worker_id for v in views] if pool == "decode" else [],
                           held=lambda pool: [v.worker_id for v in views] if pool == "decode" else [], stats={})
    scaler = Autoscaler(SimpleNamespace(pool=pool), ServeConfig(autoscale=True), Metrics(), clock=lambda: 0.0)
    d = scaler._signals(0.0).decode
    assert d.kv_usage_by_worker == (0.2, 0.9) and d.kv_usage == pytest.approx(0.55)
    assert (d.running, d.waiting, d.ready_workers) == (12, 4, 2)

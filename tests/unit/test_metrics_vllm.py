"""The vllm:* series Kubernetes inference gateways read, and counters named *_total, through
the Prometheus text format (prometheus_client's parser, as a scraper reads it)."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.observability.metrics import Metrics, TierStats, WorkerStats

# The Gateway API Inference Extension's model-server protocol, vLLM column, and the
# request-level series vLLM labels with model_name.
GATEWAY = {"vllm:num_requests_waiting": "gauge", "vllm:num_requests_running": "gauge",
           "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge"}
REQUEST_LEVEL = {"vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
                 "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
                 "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
                 "vllm:num_preemptions": "counter", "vllm:prefix_cache_queries": "counter",
                 "vllm:prefix_cache_hits": "counter"}
CUMULATIVE = ("pdserve_prefix_cache_queried_tokens", "pdserve_prefix_cache_hit_tokens", "pdserve_lease_expiries",
              "pdserve_preemptions", "pdserve_kv_page_ins", "pdserve_kv_page_outs", "pdserve_kv_tier_bytes_moved",
              "pdserve_preemptions_by_mode", "pdserve_requests", "pdserve_prompt_tokens",
              "pdserve_generation_tokens", "pdserve_kv_transfer_blocks", "pdserve_transfer_failures",
              "pdserve_routing_decisions", "pdserve_request_migrations", "pdserve_decode_reservations",
              "pdserve_decode_reservation_expiries")


def scrape(m: Metrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())}


def value(families: dict, family: str, sample: str | None = None, **labels) -> float:
    found = [s.value for s in families[family].samples
             if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (family, sample, labels, families[family].samples)
    return found[0]


@pytest.fixture
def loaded() -> Metrics:
    m = Metrics()
    m.export_vllm_names("tiny-llama", 16)
    m.observe_worker(WorkerStats("p0", "prefill", running=1, waiting=2, kv_blocks_used=30, kv_blocks_total=100,
                                 prefix_queried_tokens=500, prefix_hit_tokens=120, preemptions=0))
    m.observe_worker(WorkerStats("d0", "decode", running=3, waiting=1, kv_blocks_used=50, kv_blocks_total=300,
                                 prefix_queried_tokens=40, prefix_hit_tokens=8, lease_expiries=2, preemptions=5,
                                 tiers=TierStats(page_ins=7, swap_preemptions=4, recompute_preemptions=1)))
    m.frontend_queue.set(6)
    for s in (0.05, 0.2, 0.7):
        m.ttft.observe(s)
        m.e2e.observe(2 * s)
    m.itl.observe(0.01)
    m.prompt_tokens.inc(42)
    m.generation_tokens.inc(9)
    m.requests.labels(outcome="finished").inc(3)
    m.routing.labels(kind="remote_prefill").inc()
    return m


def test_gateway_series_have_vllm_names_types_and_cluster_wide_values(loaded):
    f = scrape(loaded)
    for name, kind in {**GATEWAY, **REQUEST_LEVEL}.items():
        assert f[name].type == kind, name
    assert value(f, "vllm:num_requests_waiting", model_name="tiny-llama") == 3         # 2 + 1 queued at workers
    assert value(f, "vllm:num_requests_running", model_name="tiny-llama") == 3         # the other 3 of 6 held
    assert value(f, "vllm:kv_cache_usage_perc", model_name="tiny-llama") == pytest.approx(80 / 400)
    assert value(f, "vllm:cache_config_info", block_size="16", num_gpu_blocks="400") == 1
    assert value(f, "vllm:num_preemptions", "vllm:num_preemptions_total") == 5
    assert value(f, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 540
    assert value(f, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 128
    loaded.prefill_gate_held.set(2)                    # two of the six wait at the prefill gate
    f = scrape(loaded)
    assert value(f, "vllm:num_requests_waiting", model_name="tiny-llama") == 5
    assert value(f, "vllm:num_requests_running", model_name="tiny-llama") == 1


def test_request_level_series_carry_model_name_and_equal_pdserve_own(loaded):
    f = scrape(loaded)
    for vllm, own in (("vllm:time_to_first_token_seconds", "pdserve_time_to_first_token_seconds"),
                      ("vllm:e2e_request_latency_seconds", "pdserve_e2e_request_latency_seconds"),
                      ("vllm:inter_token_latency_seconds", "pdserve_inter_token_latency_seconds")):
        mine = {(s.name.replace(own, vllm), tuple(sorted(s.labels.items()))): s.value for s in f[own].samples}
        theirs = {}
        for s in f[vllm].samples:
            assert s.labels.pop("model_name") == "tiny-llama", s
            theirs[(s.name, tuple(sorted(s.labels.items())))] = s.value
        assert theirs == mine
    assert value(f, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 3
    assert value(f, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_bucket", le="0.3") == 2
    assert value(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total", model_name="tiny-llama") == 42
    assert value(f, "vllm:generation_tokens", "vllm:generation_tokens_total", model_name="tiny-llama") == 9


def test_waiting_never_exceeds_what_the_frontend_holds():
    m = Metrics()
    m.export_vllm_names("m", 16)
    m.observe_worker(WorkerStats("d0", "decode", 0, 4, 0, 10, 0, 0))   # a report older than the queue depth
    m.frontend_queue.set(1)
    f = scrape(m)
    assert value(f, "vllm:num_requests_waiting") == 1 and value(f, "vllm:num_requests_running") == 0


def test_cumulative_figures_are_counters_named_total(loaded):
    f = scrape(loaded)
    for name in CUMULATIVE:
        assert f[name].type == "counter", name
        assert f[name].samples and all(s.name in (name + "_total", name + "_created") for s in f[name].samples)
    assert value(f, "pdserve_prefix_cache_hit_tokens", "pdserve_prefix_cache_hit_tokens_total", worker="d0") == 8
    assert value(f, "pdserve_preemptions_by_mode", "pdserve_preemptions_by_mode_total", worker="d0",
                 mode="swap") == 4
    for family in f.values():   # and no gauge poses as a counter
        if family.type == "gauge":
            assert not family.name.endswith("_total"), family.name


def test_forgotten_worker_leaves_the_gateway_figures():
    m = Metrics()
    m.export_vllm_names("m", 16)
    m.observe_worker(WorkerStats("d0", "decode", 1, 1, 5, 10, 0, 0))
    m.forget_worker("d0", "decode")
    f = scrape(m)
    assert not f["pdserve_requests_running"].samples
    assert value(f, "vllm:kv_cache_usage_perc") == 0 and value(f, "vllm:num_requests_waiting") == 0


def test_bad_gateway_settings_are_refused():
    with pytest.raises(ValueError, match="model_name is empty"):
        Metrics().export_vllm_names("", 16)
    with pytest.raises(ValueError, match="block_size"):
        Metrics().export_vllm_names("m", 0)

"""pdserve's figures under the names vLLM gives them, for Kubernetes inference gateways.

The Gateway API Inference Extension's endpoint picker (and llm-d's scheduler,
built on it) chooses a model-server pod from Prometheus series named as vLLM
names them (its model-server protocol, docs/proposals/003-model-server-protocol):
`vllm:num_requests_waiting` (queued requests), `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` (a 0-1 fraction despite the name) and
`vllm:cache_config_info` (an info gauge whose `block_size` and `num_gpu_blocks`
labels give the KV capacity). A pdserve head is one such pod for the whole
cluster behind it, so these are cluster-wide:

- waiting: requests queued at a worker and not yet scheduled, summed over the
  workers (their latest reports), and those the prefill gate holds at the frontend
  (prefill_queue_limit), at most the requests the frontend holds;
- running: the other requests the frontend holds (admitted, not finished);
- KV usage and capacity: device blocks used / total, summed over the workers.

vLLM's request-level series are re-exported from pdserve's own (the same
samples, renamed, with vLLM's `model_name` label): TTFT, inter-token latency,
end-to-end latency and queue time histograms, prompt and generation token
counters; the workers' preemption and prefix-cache counters are summed.
The LoRA series of the protocol (`vllm:lora_requests_info`) are not
exported: pdserve serves no adapters.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from cluster.observability.metrics import Metrics

# vLLM name -> the pdserve family whose samples it re-exports
RENAMED = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:e2e_request_latency_seconds": "e2e",
    "vllm:request_queue_time_seconds": "queue_time",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
}


class VllmNames:
    """A prometheus_client collector: vLLM-named series computed from a `Metrics` at scrape time."""

    def __init__(self, metrics: "Metrics", model_name: str, block_size: int) -> None:
        if not model_name:
            raise ValueError("model_name is empty: the vllm:* series need the served model's name")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.metrics = metrics
        self.model_name = model_name
        self.block_size = block_size

    def collect(self) -> Iterator[Metric]:
        m, name = self.metrics, self.model_name
        workers = m.workers.snapshot()
        in_flight = _value(m.frontend_queue)
        waiting = min(in_flight, sum(s.waiting for s in workers) + _value(m.prefill_gate_held))
        used = sum(s.kv_blocks_used for s in workers)
        total = sum(s.kv_blocks_total for s in workers)

        yield _gauge("vllm:num_requests_waiting", "Requests queued at a worker and not yet scheduled", name,
                     waiting)
        yield _gauge("vllm:num_requests_running", "Requests admitted and being served, not queued", name,
                     in_flight - waiting)
        yield _gauge("vllm:kv_cache_usage_perc", "KV cache usage over all workers (0-1: 1 means 100 percent)",
                     name, used / total if total else 0.0)
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration (labels; value 1)",
                                 labels=("block_size", "num_gpu_blocks", "model_name"))
        info.add_metric([str(self.block_size), str(total), name], 1.0)
        yield info
        for vllm_name, doc, total_of in (
                ("vllm:num_preemptions", "Preemptions over all workers", lambda s: s.preemptions),
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache over all workers",
                 lambda s: s.prefix_queried_tokens),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache over all workers",
                 lambda s: s.prefix_hit_tokens)):
            c = CounterMetricFamily(vllm_name, doc, labels=("model_name",))
            c.add_metric([name], float(sum(total_of(s) for s in workers)))
            yield c
        for vllm_name, attr in RENAMED.items():
            yield _renamed(getattr(m, attr), vllm_name, name)


def _value(gauge) -> float:
    """The single sample of an unlabelled prometheus_client metric (public API only)."""
    return next(iter(gauge.collect()[0].samples)).value


def _gauge(name: str, doc: str, model_name: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=("model_name",))
    g.add_metric([model_name], value)
    return g


def _renamed(source, name: str, model_name: str) -> Metric:
    """`source`'s family under `name`, every sample labelled model_name (as vLLM labels its series)."""
    family = source.collect()[0]
    out = Metric(name, family.documentation, family.type)
    for s in family.samples:
        out.add_sample(name + s.name[len(family.name):], {**s.labels, "model_name": model_name}, s.value,
                       s.timestamp, s.exemplar)
    return out

"""The disaggregated cluster end to end: real local Ray, real gRPC on
loopback, real KV transfer, the tiny random Llama."""
from __future__ import annotations

import asyncio
import random
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.cli.client import GenerationClient
from cluster.config import ServeConfig
from cluster_harness import Cluster, free_port
from tiny_models import hf_greedy, load_hf_model

pytestmark = pytest.mark.ray
BS = 16


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    cfg = ServeConfig(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512,
                      grpc_port=free_port(), http_port=0, metrics_port=0,
                      block_size=BS, prefill_workers=1, decode_workers=1,
                      max_num_batched_tokens=64,   # prompts over 64 tokens prefill in chunks
                      ray_temp_dir=str(tmp_path_factory.mktemp("ray")), worker_niceness=0,
                      # always hand off, so the tests see transfers
                      local_prefill_threshold=0, local_prefill_hit_ratio=1.0)
    c = Cluster(cfg)
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf_model(tiny_llama_dir)


async def _complete(target, ids, max_tokens=10, **kw):
    async with GenerationClient(target) as c:
        return await c.complete(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0,
                                ignore_eos=True, **kw)


def test_greedy_over_grpc_matches_transformers_for_8_concurrent(cluster, hf):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (1, 9, 16, 17, 40, 64, 90, 130)]

    async def go():
        return await asyncio.gather(*[_complete(cluster.target, p) for p in prompts])

    outs = asyncio.run(go())
    for p, out in zip(prompts, outs):
        assert out.tokens == hf_greedy(hf, p, 10)
        assert out.finish_reason == "length"
    assert cluster.sample("pdserve_routing_decisions_total", kind="remote_prefill") >= 8
    cluster.wait_idle()
    assert cluster.backend.router.open_sends == 0, "every prefill's end reached the router (handoff.py)"


def test_a_long_chunked_prompt_moves_its_last_chunk_layer_by_layer_and_matches_transformers(cluster, hf):
    """420 tokens in chunks of 64: the decode worker (another process) reads the first six
    chunks' 24 blocks whole while later chunks compute, and the last chunk's 3 blocks layer
    group by layer group while it computes (3 layers: groups of one); after the first token
    it reads only the last group. A group it skipped would make the tokens differ."""
    rng = random.Random(11)
    prompt = [rng.randrange(3, 380) for _ in range(420)]
    reserved = cluster.sample("pdserve_decode_reservations_total", outcome="reserved")
    out = asyncio.run(_complete(cluster.target, prompt, request_id="layer-wise-1"))
    assert out.tokens == hf_greedy(hf, prompt, 10)
    events = cluster.backend.request_events("layer-wise-1")
    # the reserve call and the prefill's notices race; notices that win are kept until it answers
    assert cluster.sample("pdserve_decode_reservations_total", outcome="reserved") == reserved + 1, events
    joined = [e for e in events if "joined decode" in e]
    assert joined and "27 pulled" in joined[0] and "24 read ahead whole, 3 by layer group" in joined[0], events
    cluster.wait_idle()


def test_decode_node_holding_the_prefix_pulls_fewer_blocks(cluster, hf):
    rng = random.Random(5)
    shared = [rng.randrange(3, 380) for _ in range(6 * BS)]
    first = shared + [rng.randrange(3, 380) for _ in range(20)]
    second = shared + [rng.randrange(3, 380) for _ in range(20)]
    blocks0 = cluster.sample("pdserve_kv_transfer_blocks_total")
    out1 = asyncio.run(_complete(cluster.target, first))
    cluster.wait_idle()
    blocks1 = cluster.sample("pdserve_kv_transfer_blocks_total")
    out2 = asyncio.run(_complete(cluster.target, second))
    blocks2 = cluster.sample("pdserve_kv_transfer_blocks_total")
    assert out1.tokens == hf_greedy(hf, first, 10) and out2.tokens == hf_greedy(hf, second, 10)
    pulled_first, pulled_second = blocks1 - blocks0, blocks2 - blocks1
    assert pulled_first == -(-len(first) // BS)
    assert pulled_second == pulled_first - 6, "the decode node's cached prefix must not be pulled again"
    usage = out2.usage[0]
    assert usage.cached_tokens >= 6 * BS   # the prefill node hit its cache too
    cluster.wait_idle()


def test_cancel_mid_stream_frees_blocks_on_both_sides(cluster):
    async def cancel_after_two():
        async with GenerationClient(cluster.target) as c:
            got = 0
            async for _ in c.generate(prompt_token_ids=list(range(3, 100)), max_tokens=400, temperature=0.0,
                                      ignore_eos=True):
                got += 1
                if got == 2:
                    break
        return got

    assert asyncio.run(cancel_after_two()) == 2
    states = cluster.wait_idle()
    assert states["prefill-0"].held == 0
    assert cluster.backend.router.open_sends == 0


def test_bad_input_is_invalid_argument_and_cluster_stays_up(cluster, hf):
    async def bad():
        async with GenerationClient(cluster.target) as c:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await c.complete(prompt_token_ids=[5, 6], max_tokens=0)
            return ei.value

    err = asyncio.run(bad())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in err.details()
    assert asyncio.run(_complete(cluster.target, [7, 8, 9])).tokens == hf_greedy(hf, [7, 8, 9], 10)


def test_workers_run_at_the_configured_niceness(cluster):
    """pdserve's own Ray cluster starts the engine actors at ServeConfig.worker_niceness
    (this cluster sets 0; Ray's default, and pdserve's, is 15)."""
    for wid in cluster.backend.workers:
        assert cluster.call(wid, "ready").niceness == 0


def test_health_model_info_and_metrics(cluster):
    async def info():
        async with GenerationClient(cluster.target) as c:
            return await c.health(), await c.model_info()

    health, mi = asyncio.run(info())
    assert health == "SERVING"
    assert mi.block_size == BS and dict(mi.pools) == {"prefill": 1, "decode": 1}
    before = cluster.sample("pdserve_time_to_first_token_seconds_count")
    queued = cluster.sample("pdserve_queue_time_seconds_count")
    asyncio.run(_complete(cluster.target, [11, 12, 13]))
    assert cluster.sample("pdserve_time_to_first_token_seconds_count") == before + 1
    assert cluster.sample("pdserve_queue_time_seconds_count") == queued + 1
    names = {f.name for f in text_string_to_metric_families(cluster.scrape())}
    for name in ("pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds",
                 "pdserve_e2e_request_latency_seconds", "pdserve_kv_transfer_seconds",
                 "pdserve_kv_transfer_bytes", "pdserve_requests_running", "pdserve_kv_blocks_used",
                 "pdserve_routing_decisions", "pdserve_requests", "pdserve_prefix_cache_hit_tokens",
                 "pdserve_queue_time_seconds", "pdserve_lease_expiries", "pdserve_transfer_failures",
                 "pdserve_requests_waiting", "pdserve_kv_usage_ratio", "pdserve_prefix_cache_queried_tokens"):
        assert name in names, name


def test_gateway_metrics_under_vllm_names_while_requests_run(cluster):
    """What a Kubernetes inference gateway scrapes (vllm:* beside pdserve_*), from the running
    cluster's metrics port, taken while requests stream."""
    def families(url: str) -> dict:
        with urllib.request.urlopen(url, timeout=10) as r:
            return {f.name: f for f in text_string_to_metric_families(r.read().decode())}

    def one(fams, name, sample=None):
        (v,) = [s.value for s in fams[name].samples if s.name == (sample or name)]
        return v

    async def scrape_while_streaming(n=4):
        async with GenerationClient(cluster.target) as c:
            streams = [c.generate(prompt_token_ids=list(range(3 + i, 60 + i)), max_tokens=440, temperature=0.0,
                                  ignore_eos=True) for i in range(n)]
            # all sent at once, every request has its first token: all are held by the frontend
            # (sent one after another's first token, the first could be done before the last started)
            await asyncio.gather(*[anext(s) for s in streams])
            loop = asyncio.get_running_loop()
            out = await loop.run_in_executor(None, families, cluster.stack.metrics_server.url)
            for s in streams:
                await s.aclose()
            return out

    model = cluster.backend.model_info().model_name
    f = asyncio.run(scrape_while_streaming())
    assert {f[n].type for n in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                                "vllm:kv_cache_usage_perc", "vllm:cache_config_info")} == {"gauge"}
    held = one(f, "pdserve_frontend_queue_depth")
    assert held >= 4
    waiting, running = one(f, "vllm:num_requests_waiting"), one(f, "vllm:num_requests_running")
    assert waiting == min(held, sum(s.value for s in f["pdserve_requests_waiting"].samples))
    assert waiting + running == held
    used = sum(s.value for s in f["pdserve_kv_blocks_used"].samples)
    capacity = sum(s.value for s in f["pdserve_kv_blocks_capacity"].samples)
    assert one(f, "vllm:kv_cache_usage_perc") == pytest.approx(used / capacity)
    (info,) = f["vllm:cache_config_info"].samples
    assert info.labels == {"block_size": str(BS), "num_gpu_blocks": str(int(capacity)), "model_name": model}
    assert f["vllm:prompt_tokens"].type == "counter"
    assert one(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == one(f, "pdserve_prompt_tokens",
                                                                            "pdserve_prompt_tokens_total")
    ttft = [s for s in f["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert [s.labels for s in ttft] == [{"model_name": model}]
    assert ttft[0].value == one(f, "pdserve_time_to_first_token_seconds",
                                "pdserve_time_to_first_token_seconds_count")
    assert f["pdserve_prefix_cache_hit_tokens"].type == "counter"
    cluster.wait_idle()


def _reservations(cluster) -> dict[str, float]:
    """pdserve_decode_reservations_total by outcome, from the scraped /metrics text."""
    (family,) = [f for f in text_string_to_metric_families(cluster.scrape()) if f.name == "pdserve_decode_reservations"]
    return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}


def _wait_prefill_queue_reported_empty(cluster, timeout: float = 60.0) -> None:
    """Until the router's view of the prefill node holds no queued prompt tokens: a report
    after the node drained replaced what the router had sent it."""
    async def queued() -> int:
        (p,) = cluster.backend.router.view.prefill
        return p.load.queued_prefill_tokens
    end = time.monotonic() + timeout
    while (n := cluster.loop.run(queued())) > 0:
        assert time.monotonic() < end, f"the router still sees {n} prompt tokens queued at the prefill node"
        time.sleep(0.1)


def test_decode_blocks_are_reserved_for_an_idle_prefill_node_and_not_behind_a_backlog(cluster, hf):
    """cluster/router/reserve.py as cluster/orchestration/handoff.py applies it (step: 64 tokens):
    a hand-off routed to an idle prefill node has its decode blocks reserved; of a burst of long
    prompts, those routed behind the ones already sent (a step's tokens or more queued ahead) are
    not. Counted from the head's scraped /metrics; the tokens stay transformers' greedy ones."""
    rng = random.Random(30)
    cluster.wait_idle()
    _wait_prefill_queue_reported_empty(cluster)
    before = _reservations(cluster)
    assert set(before) == {"reserved", "refused", "failed", "skipped_backlog"}   # exported from the start
    alone = [rng.randrange(3, 380) for _ in range(100)]
    out = asyncio.run(_complete(cluster.target, alone))
    assert out.tokens == hf_greedy(hf, alone, 10) and out.finish_reason == "length"
    idle = _reservations(cluster)
    assert {k: idle[k] - before[k] for k in idle} == {"reserved": 1, "refused": 0, "failed": 0, "skipped_backlog": 0}

    # 8 prompts of 300 tokens (5 steps each) at once: the first sees an idle node, the rest
    # (at least) the prompts routed before them
    burst = [[rng.randrange(3, 380) for _ in range(300)] for _ in range(8)]

    async def go():
        async with GenerationClient(cluster.target) as c:
            return await asyncio.gather(*[c.complete(prompt_token_ids=p, max_tokens=10, temperature=0.0,
                                                     ignore_eos=True) for p in burst])

    outs = asyncio.run(go())
    for p, o in zip(burst, outs):
        assert o.tokens == hf_greedy(hf, p, 10) and o.finish_reason == "length"
    after = _reservations(cluster)
    grew = {k: after[k] - idle[k] for k in after}
    assert sum(grew.values()) == len(burst), grew   # each hand-off counted once
    assert grew["skipped_backlog"] >= len(burst) // 2, grew
    assert grew["refused"] == grew["failed"] == 0, grew
    cluster.wait_idle()


def test_dead_decode_worker_fails_requests_with_unavailable_then_recovers(cluster, hf):
    import ray

    async def long_request():
        async with GenerationClient(cluster.target) as c:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async for r in c.generate(prompt_token_ids=list(range(3, 60)), max_tokens=450,
                                          temperature=0.0, ignore_eos=True):
                    if r.token_ids:
                        ray.kill(cluster.backend.workers["decode-0"].actor, no_restart=False)
            return ei.value

    err = asyncio.run(asyncio.wait_for(long_request(), 120))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    # Ray restarts the actor; the cluster serves again
    deadline = asyncio.run(_wait_serving(cluster, hf))
    assert deadline


async def _wait_serving(cluster, hf):
    for _ in range(120):
        try:
            out = await _complete(cluster.target, [21, 22, 23])
            return out.tokens == hf_greedy(hf, [21, 22, 23], 10)
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.5)
    return False

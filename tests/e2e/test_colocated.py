"""`--colocated`: workers run both phases; the prefix-aware router sends a
request to the worker that already holds its prefix."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from cluster.cli.client import GenerationClient
from cluster.config import ServeConfig
from cluster_harness import Cluster, free_port
from engine.block_hash import block_hashes
from tiny_models import hf_greedy, load_hf_model

pytestmark = pytest.mark.ray
BS = 16


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    cfg = ServeConfig(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512,
                      grpc_port=free_port(), http_port=0, metrics_port=0,
                      block_size=BS, colocated=True, decode_workers=2,
                      ray_temp_dir=str(tmp_path_factory.mktemp("ray")))
    c = Cluster(cfg)
    yield c
    c.close()


async def _complete(target, ids, max_tokens=8):
    async with GenerationClient(target) as c:
        return await c.complete(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _wait(predicate, cluster: Cluster, message: str, timeout: float = 60.0) -> None:
    """Until predicate() holds, evaluated on the frontend's loop (the router's state is not thread-safe)."""
    async def check() -> bool:
        return predicate()
    end = time.monotonic() + timeout
    while not cluster.loop.run(check()):
        assert time.monotonic() < end, message
        time.sleep(0.05)


def _hit_tokens(cluster) -> dict[str, float]:
    return {w: cluster.sample("pdserve_prefix_cache_hit_tokens_total", worker=w, pool="colocated")
            for w in cluster.backend.workers}


def test_colocated_greedy_and_prefix_routing(cluster, tiny_llama_dir):
    hf = load_hf_model(tiny_llama_dir)
    rng = random.Random(11)
    system = [rng.randrange(3, 380) for _ in range(8 * BS)]
    prompts = [system + [rng.randrange(3, 380) for _ in range(10)] for _ in range(4)]
    first = asyncio.run(_complete(cluster.target, prompts[0]))
    assert first.tokens == hf_greedy(hf, prompts[0], 8)
    prefix = set(block_hashes(system, BS))
    _wait(lambda: any(prefix <= set(cluster.backend.router.index.worker_blocks(w)) for w in cluster.backend.workers),
          cluster, "the router never indexed the first request's prefix blocks")   # its workers' KV events
    outs = [asyncio.run(_complete(cluster.target, p)) for p in prompts[1:]]
    for p, out in zip(prompts[1:], outs):
        assert out.tokens == hf_greedy(hf, p, 8)
        assert out.usage[0].cached_tokens >= 8 * BS, "the router should pick the worker holding the prefix"
    # the workers' reports carry their hit counters to the metrics
    _wait(lambda: sum(_hit_tokens(cluster).values()) >= 3 * 8 * BS, cluster, "the prefix hits never reached the metrics")
    hits = _hit_tokens(cluster)
    assert max(hits.values()) >= 3 * 8 * BS and min(hits.values()) == 0, hits
    assert cluster.sample("pdserve_routing_decisions_total", kind="local_prefill") >= 4
    cluster.wait_idle()

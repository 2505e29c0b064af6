"""A cluster with --kv-cache-dtype int8 end to end: real local Ray, real gRPC on
loopback, int8 blocks handed from the prefill pool to the decode pool, paged
to the host tier and back; tokens equal a colocated int8 engine's."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from cluster.cli.client import GenerationClient
from cluster.config import ServeConfig
from cluster_harness import Cluster, free_port
from engine import LLM, SamplingParams
from engine.block_hash import block_hashes

pytestmark = pytest.mark.ray
BS = 16
INT8_BLOCK = BS * 2 * 3 * 2 * (16 + 2)       # tiny Llama: 3 layers, 2 KV heads, head_dim 16, + bf16 scales


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    cfg = ServeConfig(model=str(tiny_llama_dir), kv_cache_dtype="int8", num_kv_blocks=24, max_model_len=256,
                      host_kv_memory="2MiB", grpc_port=free_port(), http_port=0, metrics_port=0, block_size=BS,
                      prefill_workers=1, decode_workers=1, ray_temp_dir=str(tmp_path_factory.mktemp("ray")),
                      worker_niceness=0, local_prefill_threshold=0, local_prefill_hit_ratio=1.0)
    c = Cluster(cfg)
    yield c
    c.close()


async def _complete(target, ids, max_tokens=8):
    async with GenerationClient(target) as c:
        return await c.complete(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_int8_cluster_serves_hands_off_and_pages_to_host(cluster, tiny_llama_dir):
    rng = random.Random(23)
    a = [rng.randrange(3, 380) for _ in range(5 * BS + 10)]
    others = [[rng.randrange(3, 380) for _ in range(6 * BS + 4)] for _ in range(4)]
    local = LLM(str(tiny_llama_dir), kv_cache_dtype="int8", block_size=BS, num_kv_blocks=96, max_model_len=256,
                enable_prefix_caching=False)
    expect = {tuple(p): local.generate([p], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
              .outputs[0].token_ids for p in [a, *others]}

    blocks0 = cluster.sample("pdserve_kv_transfer_blocks_total")
    bytes0 = cluster.sample("pdserve_kv_transfer_bytes_sum")
    first = asyncio.run(_complete(cluster.target, a))
    assert first.tokens == expect[tuple(a)]
    # the workers' KV events carry int8-domain hashes, the ones the frontend computes for routing
    int8_hashes = block_hashes(a, BS, kv_cache_dtype="int8")
    deadline = time.monotonic() + 10
    while not set(int8_hashes) <= set(cluster.backend.router.index.worker_blocks("prefill-0")):
        assert time.monotonic() < deadline, "the router never saw the prefill node's int8 blocks"
        time.sleep(0.05)
    assert not set(block_hashes(a, BS)) & set(cluster.backend.router.index.worker_blocks("prefill-0"))
    for p in others:                              # 7 blocks each: a's blocks leave the 24-block pools
        assert asyncio.run(_complete(cluster.target, p)).tokens == expect[tuple(p)]
        cluster.wait_idle()
    again = asyncio.run(_complete(cluster.target, a))
    assert again.tokens == expect[tuple(a)]
    assert again.usage[0].cached_tokens >= 5 * BS, "a's blocks should come back from the host tier"

    blocks = cluster.sample("pdserve_kv_transfer_blocks_total") - blocks0
    moved = cluster.sample("pdserve_kv_transfer_bytes_sum") - bytes0
    assert blocks > 0 and moved == blocks * INT8_BLOCK, "int8 blocks (scales inside) cross between pools"
    stats = {w: cluster.call(w, "report").stats for w in cluster.backend.workers}
    assert sum(s.kv_page_outs for s in stats.values()) > 0
    assert sum(s.kv_page_ins for s in stats.values()) > 0
    assert all(s.kv_host_blocks_total == (2 << 20) // INT8_BLOCK for s in stats.values())
    cluster.wait_idle()

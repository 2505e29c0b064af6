"""Each worker bounds its own queue (max_worker_queue): a burst beyond what the
workers may queue is spread to other workers or refused with RESOURCE_EXHAUSTED
and a retry hint; every request that runs gives exactly the greedy tokens, and
nothing leaks."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.cli.client import GenerationClient
from cluster.config import ServeConfig
from cluster_harness import Cluster, free_port
from tiny_models import hf_greedy, load_hf_model

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    cfg = ServeConfig(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512,
                      grpc_port=free_port(), http_port=0, metrics_port=0,
                      prefill_workers=1, decode_workers=2, max_num_seqs=1, max_worker_queue=1,
                      local_prefill_threshold=0, ray_temp_dir=str(tmp_path_factory.mktemp("ray")))
    c = Cluster(cfg)
    yield c
    c.close()


def test_burst_beyond_worker_queues_is_spread_or_refused(cluster, tiny_llama_dir):
    hf = load_hf_model(tiny_llama_dir)
    prompts = [list(range(3 + i, 30 + i)) for i in range(12)]
    max_tokens = 24
    busy0 = cluster.backend.journal.counters.busy

    async def one(ids):
        async with GenerationClient(cluster.target) as c:
            try:
                out = await c.complete(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True, timeout=120)
                return out.tokens, None
            except grpc.aio.AioRpcError as e:
                return None, e

    async def go():
        return await asyncio.gather(*[one(p) for p in prompts])

    outs = asyncio.run(go())
    refused = 0
    for p, (tokens, err) in zip(prompts, outs):
        if err is None:
            assert tokens == hf_greedy(hf, p, max_tokens)
            continue
        refused += 1
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
        assert "max_worker_queue" in err.details()
        assert int(dict(err.trailing_metadata())["retry-after-ms"]) > 0
    busy = cluster.backend.journal.counters.busy - busy0
    assert busy >= 1, "no worker ever refused: the burst did not exceed the queue bounds"
    assert refused < len(prompts), "nothing ran"
    cluster.wait_idle()

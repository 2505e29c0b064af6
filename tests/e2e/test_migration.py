"""A decode worker dies mid-stream: the request continues on the other decode
worker and the client sees one uninterrupted stream with the tokens of an
undisturbed greedy run."""
from __future__ import annotations

import asyncio

import pytest
import ray

from cluster.cli.client import GenerationClient
from cluster.config import ServeConfig
from cluster_harness import Cluster, free_port
from tiny_models import hf_greedy, load_hf_model

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    cfg = ServeConfig(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512,
                      grpc_port=free_port(), http_port=0, metrics_port=0,
                      prefill_workers=1, decode_workers=2, max_migrations=1,
                      ray_temp_dir=str(tmp_path_factory.mktemp("ray")))
    c = Cluster(cfg)
    yield c
    c.close()


def test_killed_decode_worker_migrates_streams_exactly(cluster, tiny_llama_dir):
    hf = load_hf_model(tiny_llama_dir)
    prompts = [list(range(3 + i, 40 + i)) for i in range(4)]
    max_tokens = 150     # the kill after 10 streamed tokens must land while decode still runs
    killed: list[str] = []

    async def one(ids):
        async with GenerationClient(cluster.target) as c:
            tokens = []
            async for r in c.generate(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0,
                                      ignore_eos=True):
                tokens += list(r.token_ids)
                if len(tokens) >= 10 and not killed:
                    victim = next(w for w, ref in cluster.backend.workers.items()
                                  if ref.pool == "decode" and any(
                                      st.decode_id == w for st in cluster.backend.in_flight.values()))
                    killed.append(victim)
                    ray.kill(cluster.backend.workers[victim].actor, no_restart=False)
            return tokens

    async def go():
        return await asyncio.gather(*[one(p) for p in prompts])

    outs = asyncio.run(asyncio.wait_for(go(), 180))
    assert killed, "no decode worker was killed"
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(hf, p, max_tokens)
    assert cluster.sample("pdserve_request_migrations_total") >= 1

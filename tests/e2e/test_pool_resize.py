"""Pools that change size while serving (cluster/orchestration/pool.py grow, drain.py
retire_worker): a new worker is routed to once ready; a retired one empties first (queued
requests move, running ones finish, leases are released) and then leaves. Every request
finishes with the tokens of an undisturbed greedy run and no block leaks."""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster.cli.client import GenerationClient
from cluster.config import ServeConfig
from cluster_harness import Cluster, free_port
from tiny_models import hf_greedy, load_hf_model

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    cfg = ServeConfig(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512, grpc_port=free_port(), http_port=0,
                      metrics_port=0, prefill_workers=1, decode_workers=1, cpus_per_worker=0.25,
                      local_prefill_threshold=0, ray_temp_dir=str(tmp_path_factory.mktemp("ray")))
    c = Cluster(cfg)
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf_model(tiny_llama_dir)


def on_loop(cluster: Cluster, fn):
    """fn() on the frontend's loop (its state is not thread-safe)."""
    async def call():
        return fn()
    return cluster.loop.run(call())


def routed(cluster: Cluster, pool: str) -> set[str]:
    view = on_loop(cluster, lambda: cluster.backend.router.view)
    return {v.worker_id for v in (view.prefill if pool == "prefill" else view.decode)}


def wait_routed(cluster: Cluster, pool: str, worker_id: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while worker_id not in routed(cluster, pool):
        assert time.monotonic() < end, f"{worker_id} never became routable: {routed(cluster, pool)}"
        time.sleep(0.1)


async def stream(cluster: Cluster, ids: list[int], max_tokens: int, started: asyncio.Event | None = None):
    async with GenerationClient(cluster.target) as c:
        tokens: list[int] = []
        async for r in c.generate(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
            tokens += list(r.token_ids)
            if started is not None and len(tokens) >= 4:
                started.set()
        return tokens


def run_while(cluster: Cluster, prompts, max_tokens: int, action):
    """Stream every prompt; once the first has tokens, run `action()` on the frontend loop."""
    async def go():
        started = asyncio.Event()
        streams = [asyncio.ensure_future(stream(cluster, p, max_tokens, started)) for p in prompts]
        await asyncio.wait_for(started.wait(), 120)
        result = await asyncio.wrap_future(cluster.loop.submit(action()))
        return result, await asyncio.wait_for(asyncio.gather(*streams), 240)
    return asyncio.run(go())


@pytest.mark.parametrize("pool", ["decode", "prefill"])
def test_a_pool_grows_then_retires_its_first_worker_under_load(cluster, hf, pool):
    before = set(cluster.backend.workers)
    new = cluster.loop.run(cluster.backend.grow_pool(pool), timeout=300)
    assert new not in before and cluster.backend.workers[new].pool == pool
    wait_routed(cluster, pool, new)
    first = sorted(w for w in before if cluster.backend.workers[w].pool == pool)[0]
    prompts = [list(range(5 + i, 70 + i)) for i in range(6)]
    retired, outs = run_while(cluster, prompts, 40, lambda: cluster.backend.retire_worker(first, 120))
    assert retired is True
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(hf, p, 40)
    assert first not in cluster.backend.workers and first not in routed(cluster, pool)
    assert routed(cluster, pool) == {new}
    cluster.wait_idle()
    after = [list(range(9, 50))]   # the pool still serves, on the new worker
    assert asyncio.run(stream(cluster, after[0], 12)) == hf_greedy(hf, after[0], 12)
    assert cluster.sample("pdserve_pool_workers", pool=pool) == 1

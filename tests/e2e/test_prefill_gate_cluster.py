"""The prefill gate (prefill_queue_limit 0) in a real cluster: a burst larger than the prefill
pool is held at the frontend and routed as reports show room, every request streams exactly
transformers' greedy tokens, a client that gives up while held leaves nothing behind, and the
gate's metrics say what it did."""
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
                      prefill_workers=2, decode_workers=1, prefill_queue_limit=0,
                      local_prefill_threshold=0, local_prefill_hit_ratio=1.0,
                      ray_temp_dir=str(tmp_path_factory.mktemp("ray")))
    c = Cluster(cfg)
    yield c
    c.close()


def _gate(cluster) -> tuple[float, float, float]:
    """(requests through the gate, of them held, seconds held in all)."""
    n = cluster.sample("pdserve_prefill_gate_wait_seconds_count")
    not_held = cluster.sample("pdserve_prefill_gate_wait_seconds_bucket", le="0.0")
    return n, n - not_held, cluster.sample("pdserve_prefill_gate_wait_seconds_sum")


def _occupy(cluster, on: bool) -> None:
    """A long prefill outstanding on every prefill node, as the gate counts them (on), or gone
    again (off: its end releases what is held). The tiny model's own prefills end within
    milliseconds, too fast to keep a node busy while a test looks."""
    pool = cluster.backend.pool

    async def occupy():                 # on the stack's loop, where the gate lives
        for w in pool.serving("prefill"):
            if on:
                pool.gate.outstanding.sent(f"busy-{w}", w, 10_000)
            else:
                pool.gate.ended(f"busy-{w}")
    cluster.loop.run(occupy())


def test_a_burst_is_held_then_routed_and_streams_greedy_tokens(cluster, tiny_llama_dir):
    hf = load_hf_model(tiny_llama_dir)
    prompts = [list(range(5 + i, 5 + i + 120)) for i in range(12)]
    n0, held0, s0 = _gate(cluster)

    async def one(ids):
        async with GenerationClient(cluster.target) as c:
            return (await c.complete(prompt_token_ids=ids, max_tokens=8, temperature=0.0, ignore_eos=True,
                                     timeout=120)).tokens

    async def go():
        calls = asyncio.gather(*[one(p) for p in prompts])
        for _ in range(600):            # until every request waits at the gate
            if cluster.sample("pdserve_prefill_gate_held") == len(prompts):
                break
            await asyncio.sleep(0.01)
        held_now = cluster.sample("pdserve_prefill_gate_held")
        _occupy(cluster, False)         # the nodes free up: the gate routes the burst
        return held_now, await calls

    _occupy(cluster, True)
    try:
        held_now, outs = asyncio.run(go())
    finally:
        _occupy(cluster, False)
    assert held_now == len(prompts)
    for p, tokens in zip(prompts, outs):
        assert tokens == hf_greedy(hf, p, 8)
    n, held, seconds = _gate(cluster)
    assert (n - n0, held - held0) == (len(prompts), len(prompts)) and seconds > s0
    pool = cluster.backend.pool
    assert cluster.sample("pdserve_prefill_gate_held") == 0 and len(pool.gate) == 0
    assert pool.router.open_sends == 0 and len(pool.gate.outstanding) == 0
    cluster.wait_idle()


def test_a_client_that_gives_up_while_held_leaves_nothing(cluster):
    """Every prefill node busy for the whole request: it waits at the gate until its deadline
    cancels it there."""
    pool = cluster.backend.pool
    n0, held0, _ = _gate(cluster)
    _occupy(cluster, True)
    try:
        async def give_up():
            async with GenerationClient(cluster.target) as c:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.complete(prompt_token_ids=list(range(3, 200)), max_tokens=4, temperature=0.0,
                                     ignore_eos=True, timeout=1.0)
                return e.value.code()

        assert asyncio.run(give_up()) == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        _occupy(cluster, False)
    assert len(pool.gate) == 0 and cluster.sample("pdserve_prefill_gate_held") == 0
    n, held, _ = _gate(cluster)
    assert (n, held) == (n0, held0), "the request that gave up was routed"
    assert pool.router.open_sends == 0 and len(pool.gate.outstanding) == 0
    cluster.wait_idle()

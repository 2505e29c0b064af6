"""`first_token_release: decode`: the prefill node's first token reaches the client only
once the decode node has taken the request into its running batch. Real local Ray, gRPC
and HTTP, the tiny random Llama; outputs against transformers' greedy tokens, order
against each request's trace (never against timing)."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import ray

from cluster.cli.client import GenerationClient
from cluster.config import ServeConfig
from cluster_harness import Cluster, free_port
from grpc_harness import http_greedy_tokens
from tiny_models import hf_greedy

pytestmark = pytest.mark.ray
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    cfg = ServeConfig(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512,
                      grpc_port=free_port(), http_port=free_port(), metrics_port=0,
                      prefill_workers=1, decode_workers=2, max_migrations=1, first_token_release="decode",
                      ray_temp_dir=str(tmp_path_factory.mktemp("ray")), worker_niceness=0,
                      local_prefill_threshold=0, local_prefill_hit_ratio=1.0)   # always hand off
    c = Cluster(cfg)
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf(tiny_llama_hf):
    return tiny_llama_hf


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randrange(20, 90))] for _ in range(n)]


async def _grpc(target: str, ids: list[int], max_tokens: int = MAX_TOKENS, request_id: str = "") -> list[int]:
    async with GenerationClient(target) as c:
        tokens: list[int] = []
        async for r in c.generate(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                  request_id=request_id):
            tokens += list(r.token_ids)
        return tokens


def _index(events: list[str], prefix: str) -> int:
    hits = [i for i, e in enumerate(events) if e.startswith(prefix)]
    assert len(hits) == 1, (prefix, events)
    return hits[0]


def test_greedy_over_grpc_and_http_matches_transformers_with_the_token_held(cluster, hf):
    grpc_prompts, http_prompts = _prompts(1, 4), _prompts(2, 2)
    held0 = cluster.sample("pdserve_handoff_seconds_count", stage="hold")

    async def go():
        http = [asyncio.to_thread(http_greedy_tokens, cluster.stack.http.url, p, MAX_TOKENS) for p in http_prompts]
        return await asyncio.gather(*[_grpc(cluster.target, p) for p in grpc_prompts], *http)

    outs = asyncio.run(asyncio.wait_for(go(), 180))
    for p, out in zip(grpc_prompts + http_prompts, outs):
        assert out == hf_greedy(hf, p, MAX_TOKENS)
    assert cluster.sample("pdserve_handoff_seconds_count", stage="hold") - held0 == 6
    assert cluster.sample("pdserve_handoff_seconds_count", stage="admit") >= 6
    cluster.wait_idle()


def test_the_first_token_is_released_only_after_the_decode_nodes_admission(cluster, hf):
    [p] = _prompts(3, 1)
    assert asyncio.run(_grpc(cluster.target, p, request_id="held-1")) == hf_greedy(hf, p, MAX_TOKENS)
    events = cluster.backend.request_events("held-1")
    admitted, released = _index(events, "admitted by decode"), _index(events, "first token released")
    assert admitted < released and events[released].endswith("(admitted)"), events
    base = cluster.backend.config   # the same request with the token streamed as the prefill node samples it
    cluster.backend.config = dataclasses.replace(base, first_token_release="prefill")
    try:
        assert asyncio.run(_grpc(cluster.target, p, request_id="streamed-1")) == hf_greedy(hf, p, MAX_TOKENS)
    finally:
        cluster.backend.config = base
    events = cluster.backend.request_events("streamed-1")
    assert _index(events, "first token released") < _index(events, "admitted by decode"), events
    cluster.wait_idle()


def test_a_request_that_ends_at_its_first_token_is_not_held(cluster, hf):
    [p] = _prompts(4, 1)
    assert asyncio.run(_grpc(cluster.target, p, max_tokens=1, request_id="one-token")) == hf_greedy(hf, p, 1)
    events = cluster.backend.request_events("one-token")
    assert any(e.startswith("prefilled on") for e in events), events
    assert not any(e.startswith(("first token released", "admitted by", "joined")) for e in events), events
    cluster.wait_idle()


def test_a_decode_node_lost_before_admission_streams_the_held_token_exactly_once(cluster, hf):
    [p] = _prompts(5, 1)
    killed: list[str] = []

    async def after_prefill(job, ref, result):   # on the frontend's loop: the token held, D not joined yet
        if not killed:
            handoff = cluster.backend.in_flight[job.request_id]
            assert handoff.reservation is not None
            killed.append(handoff.reservation.worker_id)
            ray.kill(cluster.backend.workers[killed[0]].actor, no_restart=False)
            await asyncio.sleep(0.5)

    cluster.backend.hooks.after_prefill = after_prefill
    try:
        out = asyncio.run(asyncio.wait_for(_grpc(cluster.target, p, request_id="lost-1"), 180))
    finally:
        cluster.backend.hooks.after_prefill = None
    assert killed, "the fault never fired"
    assert out == hf_greedy(hf, p, MAX_TOKENS)   # the held token once: no gap, no duplicate
    events = cluster.backend.request_events("lost-1")
    assert "migrations" in events, events
    released = events[_index(events, "first token released")]
    assert "before admission" in released or "lost" in released, events
    cluster.settle()

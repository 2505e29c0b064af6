"""pdserve across three test hosts (Linux namespaces: own network, PID, IPC, UTS
and mount namespace each): Ray head and frontend on h1, the prefill pool on h2,
the decode pool on h3, KV over the veth links. Needs root; skips elsewhere."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from cluster.client import GenerationClient
from cluster.testbed import TestBed
from cluster.testbed.sys_cmd import need_root
from testbed_cluster import MultiHostServe
from tiny_models import hf_greedy, load_hf_model

pytestmark = [pytest.mark.ray, pytest.mark.skipif(bool(need_root()), reason=need_root() or "root")]


@pytest.fixture(scope="module")
def three_hosts(tiny_llama_dir):
    with TestBed.up(3) as bed:
        serve = MultiHostServe(bed, tiny_llama_dir)
        try:
            yield bed, serve
        finally:
            serve.stop()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf_model(tiny_llama_dir)


def _grpc(target: str, prompt: list[int], max_tokens: int) -> list[int]:
    async def go():
        async with GenerationClient(target) as c:
            out = await c.complete(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                   ignore_eos=True, timeout=120)
            return list(out.token_ids)
    return asyncio.run(go())


def test_pools_land_on_their_hosts_and_bind_their_own_addresses(three_hosts):
    bed, serve = three_hosts
    workers = serve.workers()
    assert {w: (i["hostname"], i["address"]) for w, i in workers.items()} == {
        "prefill-0": ("h2", bed.host("h2").address), "decode-0": ("h3", bed.host("h3").address)}
    assert serve.grpc_target.startswith(bed.host("h1").address + ":")
    assert serve.http_url.startswith(f"http://{bed.host('h1').address}:")
    assert serve.metrics_url.startswith(f"http://{bed.host('h1').address}:")


def test_greedy_over_grpc_and_http_equals_transformers_and_kv_crosses_the_link(three_hosts, hf):
    bed, serve = three_hosts
    prefill_host = bed.host("h2")
    prompt = [(7 * i + 3) % 370 + 5 for i in range(300)]
    want = hf_greedy(hf, prompt, 12)
    sent_before = prefill_host.link_bytes()[0]
    assert _grpc(serve.grpc_target, prompt, 12) == want
    sent = prefill_host.link_bytes()[0] - sent_before
    kv_bytes = 300 // 16 * 16 * 3 * 2 * 2 * 16 * 4   # full blocks x layers x (K, V) x kv heads x head dim x fp32
    assert sent >= kv_bytes, f"the prefill host sent {sent} bytes, less than the prompt's KV ({kv_bytes})"
    body = json.dumps({"prompt": prompt[:40], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                       "logprobs": 0, "return_tokens_as_token_ids": True}).encode()
    req = urllib.request.Request(serve.http_url + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        tokens = json.loads(r.read())["choices"][0]["logprobs"]["tokens"]
    assert [int(t.removeprefix("token_id:")) for t in tokens] == hf_greedy(hf, prompt[:40], 8)

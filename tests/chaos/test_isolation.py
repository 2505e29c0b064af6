"""Prefix-cache isolation, paired: the same prompt with the same salt hits the
cache (positive control: the test can see a hit), with a different salt it
never does; with API keys the salt comes from the key's tenant, so two tenants
sending the same client salt never share. On the local engine and on the
disaggregated cluster (prefill and decode caches)."""
from __future__ import annotations

import asyncio
import random

import pytest

from cluster.cli.client import GenerationClient
from cluster.frontends.auth import ApiKeys
from grpc_harness import start_frontend

PROMPT_LEN = 64          # 4 full blocks of 16


@pytest.fixture(scope="module")
def fe(tiny_llama_dir):
    f = start_frontend(tiny_llama_dir)
    yield f
    f.close()


async def _cached(target: str, ids: list[int], salt: str = "", api_key: str | None = None) -> int:
    async with GenerationClient(target, api_key=api_key) as c:
        out = await c.complete(prompt_token_ids=ids, max_tokens=2, temperature=0.0, cache_salt=salt)
    return out.usage[0].cached_tokens


def _pairs(target: str, rng: random.Random, n: int, indexed=None) -> list[tuple[int, int, int, int, int]]:
    """Per fresh prompt: (first, same salt, other salt, unsalted, unsalted again) cached tokens.
    indexed(ids, salt): waits until the router knows where the prompt is cached (cluster)."""
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, 380) for _ in range(PROMPT_LEN)]
        a, b = f"salt-{rng.random()}", f"salt-{rng.random()}"

        async def go():
            first = await _cached(target, ids, a)
            if indexed:
                await indexed(ids, a)
            same, other, plain = await _cached(target, ids, a), await _cached(target, ids, b), await _cached(target, ids)
            if indexed:
                await indexed(ids, None)
            return first, same, other, plain, await _cached(target, ids)
        out.append(asyncio.run(go()))
    return out


def _check(results) -> None:
    for first, same, other, plain, plain_again in results:
        assert first == 0, "a fresh random prompt cannot be cached yet"
        assert same >= PROMPT_LEN - 16, "positive control: the same salt must hit the cache"
        assert other == 0 and plain == 0, "a different salt (or none) must never hit"
        assert plain_again >= PROMPT_LEN - 16, "positive control without salt"


def test_salts_isolate_the_prefix_cache_local(fe):
    _check(_pairs(fe.target, random.Random(11), 10))


def test_api_key_tenants_never_share_even_with_the_same_client_salt(fe):
    srv = fe.serve_another(api_keys=ApiKeys.parse([("key-alice", "alice"), ("key-bob", "bob")]))
    rng = random.Random(12)
    for _ in range(5):
        ids = [rng.randrange(3, 380) for _ in range(PROMPT_LEN)]

        async def go():
            return (await _cached(srv.target, ids, "shared", "key-alice"),
                    await _cached(srv.target, ids, "shared", "key-alice"),
                    await _cached(srv.target, ids, "shared", "key-bob"),
                    await _cached(srv.target, ids, "", "key-bob"),
                    await _cached(srv.target, ids, "alice/shared", "key-bob"))
        first, same, bob, bob_plain, bob_spoof = asyncio.run(go())
        assert first == 0 and same >= PROMPT_LEN - 16, "positive control: one tenant hits its own cache"
        assert bob == bob_plain == bob_spoof == 0, "another tenant never reaches it, whatever salt it sends"


@pytest.mark.ray
def test_salts_isolate_the_prefix_cache_on_the_cluster(chaos_cluster):
    from engine.block_hash import block_hashes

    c = chaos_cluster
    c.settle()

    async def indexed(ids, salt):   # the router learns of cached blocks from reports, every 100 ms
        hashes = tuple(block_hashes(ids, 16, salt))
        while not any(w.startswith("prefill") for w in await c.on_loop(lambda: c.backend.router.index.match(hashes))):
            await asyncio.sleep(0.02)

    _check(_pairs(c.target, random.Random(13), 4, indexed))
    c.settle()

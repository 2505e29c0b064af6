"""LoadOrder, and the prefix-aware policy's fast pick against costing every worker."""
from __future__ import annotations

import random

import pytest

from cluster.router import PolicyConfig, Router, RouterConfig, RoutingRequest, WorkerLoad
from cluster.router.load_order import LoadOrder
from cluster.router.policy import WorkerView
from engine.kv_events import KVEvent, KVEventKind, Tier


def view(wid: str, queued: int) -> WorkerView:
    return WorkerView(wid, "prefill", WorkerLoad(queued_prefill_tokens=queued))


def key(load: WorkerLoad) -> float:
    return float(load.queued_prefill_tokens)


def test_lowest_first_ties_to_lowest_id_and_skip():
    order = LoadOrder([view("c", 5), view("a", 5), view("b", 9), view("d", 1)], key)
    assert order.first_outside(()) == (1.0, view("d", 1))
    assert order.first_outside({"d"})[1].worker_id == "a"          # tie 5/5: lowest id
    assert order.first_outside({"d", "a"})[1].worker_id == "c"
    assert order.first_outside({"a", "b", "c", "d"}) is None
    assert order.first_outside({"d"})[1].worker_id == "a"          # skipped entries were put back
    assert len(order) == 4


def test_updates_move_workers_and_stale_entries_never_surface():
    order = LoadOrder([view(f"w{i}", 100) for i in range(5)], key)
    order.update(view("w3", 0))
    assert order.first_outside(())[1].worker_id == "w3"
    order.update(view("w3", 200))                                  # the old entry is stale now
    assert order.first_outside(())[1].worker_id == "w0"
    order.update(view("w0", 100))                                  # same key: same place, new view
    assert order.get("w0")[1] == view("w0", 100)
    rng = random.Random(0)
    loads = {f"w{i}": 100 for i in range(5)} | {"w3": 200}
    for _ in range(2000):                                          # forces compaction many times
        w = f"w{rng.randrange(5)}"
        loads[w] = rng.randrange(50)
        order.update(view(w, loads[w]))
        want = min(loads, key=lambda x: (loads[x], x))
        assert order.first_outside(())[1].worker_id == want
    assert len(order._heap) <= 2 * len(order) + 64
    with pytest.raises(ValueError, match="not in this LoadOrder"):
        order.update(view("nobody", 1))


def _router(n: int, temperature: float = 0.0) -> Router:
    r = Router(RouterConfig(policy_config=PolicyConfig(temperature=temperature)),
               rng=random.Random(1), clock=lambda: 0.0)
    for i in range(n):
        r.add_worker(f"w{i:03d}", "prefill" if i % 2 else "decode")
    return r


def test_fast_pick_equals_costing_every_worker():
    """Random caches, loads drawn from a small grid (many ties), workers dying and
    coming back: the fast pick and the full scan choose the same worker at the same cost."""
    rng = random.Random(7)
    n, bs = 160, 16
    router = _router(n)
    policy = router.policy
    chains = [[rng.getrandbits(63) for _ in range(12)] for _ in range(30)]
    next_id = {f"w{i:03d}": 1 for i in range(n)}

    def store(wid: str, hashes, tier=Tier.DEVICE):
        router.on_events(wid, [KVEvent(next_id[wid], KVEventKind.STORED, tuple(hashes), None, tier)])
        next_id[wid] += 1

    for _ in range(200):
        chain = rng.choice(chains)
        store(f"w{rng.randrange(n):03d}", chain[:rng.randint(1, 12)],
              Tier.HOST if rng.random() < 0.2 else Tier.DEVICE)
    fast_used = 0
    for step in range(600):
        wid = f"w{rng.randrange(n):03d}"
        roll = rng.random()
        if roll < 0.3:
            router.update_load(wid, WorkerLoad(queued_prefill_tokens=rng.choice([0, 0, 64, 128]),
                                               running=rng.choice([0, 1, 2]), kv_usage=rng.choice([0.0, 0.5])))
        elif roll < 0.33:
            router.on_worker_dead(wid)
        chain = rng.choice(chains)
        prompt_blocks = rng.randint(1, 12)
        req = RoutingRequest(f"r{step}", prompt_blocks * bs + rng.randrange(bs), tuple(chain[:prompt_blocks]), bs)
        view = router.view
        matches = router.index.match(req.block_hashes)
        for pick, workers in ((policy.pick_decode, view.decode), (policy.pick_prefill, view.prefill)):
            fast_used += policy._fast(workers, "decode" if workers is view.decode else "prefill", matches) is not None
            got, got_cost = pick(req, workers, matches)
            want, want_cost = pick(req, list(workers), matches)        # not the synced view: full scan
            assert (got.worker_id, got_cost) == (want.worker_id, want_cost), step
        router.route(req)                                               # moves pending loads on
    assert fast_used > 600, fast_used


def test_small_pools_and_nonzero_temperature_use_the_full_scan():
    small = _router(100)
    assert small.view and small.policy._synced is None
    warm = _router(160, temperature=0.5)
    assert warm.view and warm.policy._synced is None
    big = _router(160)
    assert big.view and big.policy._synced is big.view

"""RoleCosts and Matches, and the prefix-aware policy's array pick against costing
every worker in Python."""
from __future__ import annotations

import random

import numpy as np
import pytest

from cluster.router import PolicyConfig, Router, RouterConfig, RoutingRequest, WorkerLoad
from cluster.router.cost_vector import RoleCosts
from cluster.router.index import Matches, MatchInfo, PrefixIndex
from cluster.router.inflight import InFlightMatch
from cluster.router.policy import WorkerView, with_in_flight
from engine.kv_events import KVEvent, KVEventKind, Tier


def view(wid: str, queued: int) -> WorkerView:
    return WorkerView(wid, "prefill", WorkerLoad(queued_prefill_tokens=queued))


def key(load: WorkerLoad) -> float:
    return float(load.queued_prefill_tokens)


def test_role_costs_positions_of_small_and_large_masks_skip_non_members():
    ids = [f"w{i}" for i in range(100)]
    members = [view(w, i) for i, w in enumerate(ids) if i % 3]            # every third worker is not here
    rc = RoleCosts(members, key)
    pos = {v.worker_id: i for i, v in enumerate(members)}
    rng = random.Random(3)
    for size in (0, 1, 5, 12, 13, 40, 100):                              # both sides of the bit-walk cut
        bits = rng.sample(range(100), size)
        mask = sum(1 << b for b in bits)
        want = sorted(pos[ids[b]] for b in bits if ids[b] in pos)
        assert sorted(int(p) for p in rc.positions(mask, ids)) == want, size
    ids.append("w1")                     # a bit the index assigns later (re-added name: same member)
    assert [int(p) for p in rc.positions((1 << 100) | sum(1 << b for b in range(20)), ids)][-1] == pos["w1"]


def test_role_costs_update_moves_one_key_and_refuses_strangers():
    members = [view(f"w{i}", 10 * i) for i in range(5)]
    rc = RoleCosts(members, key)
    assert rc.keys.tolist() == [0.0, 10.0, 20.0, 30.0, 40.0]
    new = view("w3", 1)
    views = tuple(new if v.worker_id == "w3" else v for v in members)
    rc.update(new, views)
    assert rc.keys.tolist() == [0.0, 10.0, 20.0, 1.0, 40.0] and rc.views[3] is new
    with pytest.raises(ValueError, match="not in this RoleCosts"):
        rc.update(view("nobody", 1), views)


def test_matches_reads_as_a_mapping_later_groups_override_and_bitless_workers_go_to_extra():
    idx = PrefixIndex()
    idx.apply("a", [KVEvent(1, KVEventKind.STORED, (1, 2, 3), None, Tier.DEVICE)])
    idx.apply("b", [KVEvent(1, KVEventKind.STORED, (1,), None, Tier.DEVICE)])
    m = idx.match([1, 2, 3])
    assert isinstance(m, Matches) and m == {"a": MatchInfo(3), "b": MatchInfo(1)} and len(m) == 2
    assert [info for _, info in m.groups] == [MatchInfo(1), MatchInfo(3)]
    with_in_flight(m, InFlightMatch("b", 3))
    assert m["b"] == MatchInfo(1, in_flight_blocks=2) and m.get("a") == MatchInfo(3)
    with_in_flight(m, InFlightMatch("fresh", 2))                         # never reported: no index bit
    assert m.extra == {"fresh": MatchInfo(0, in_flight_blocks=2)} and "fresh" in m and "c" not in m
    assert dict(m) == {"a": MatchInfo(3), "b": MatchInfo(1, in_flight_blocks=2),
                       "fresh": MatchInfo(0, in_flight_blocks=2)}
    with pytest.raises(KeyError):
        m["c"]


def _router(n: int, temperature: float = 0.0, seed: int = 1) -> Router:
    r = Router(RouterConfig(policy_config=PolicyConfig(temperature=temperature)),
               rng=random.Random(seed), clock=lambda: 0.0, native_decisions=False)   # the Python policy
    for i in range(n):
        r.add_worker(f"w{i:03d}", "prefill" if i % 2 else "decode")
    return r


@pytest.mark.parametrize("n", [160, 64, 20])       # 80 a role: numpy arrays; 32 and 10: Python lists
@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_array_pick_equals_costing_every_worker(temperature, n):
    """Random caches over three tiers, a prefix most workers hold, loads drawn from a
    small grid (many ties), in-flight and overriding matches, workers dying and coming back: the
    array pick and the Python scan choose the same worker at the same cost (with the
    same random draws above temperature 0)."""
    rng = random.Random(7)
    bs = 16
    router = _router(n, temperature)
    policy = router.policy
    common = [rng.getrandbits(63) for _ in range(2)]
    chains = [common + [rng.getrandbits(63) for _ in range(10)] for _ in range(30)]
    next_id = {f"w{i:03d}": 1 for i in range(n)}

    def store(wid: str, hashes, tier=Tier.DEVICE):
        router.on_events(wid, [KVEvent(next_id[wid], KVEventKind.STORED, tuple(hashes), None, tier)])
        next_id[wid] += 1

    for i in range(n - 10):                                   # the common prefix: on most workers
        store(f"w{i:03d}", common)
    for _ in range(300):
        chain = rng.choice(chains)
        store(f"w{rng.randrange(n):03d}", chain[:rng.randint(1, 12)],
              rng.choice([Tier.DEVICE] * 6 + [Tier.HOST, Tier.DISK]))
    vector_used = 0
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
        if rng.random() < 0.3:
            with_in_flight(matches, InFlightMatch(f"w{rng.randrange(n + 20):03d}", prompt_blocks))
        if rng.random() < 0.3:                                   # a later plain match overrides any other
            matches[f"w{rng.randrange(n):03d}"] = MatchInfo(rng.randint(0, prompt_blocks))
        for pick, workers, role in ((policy.pick_decode, view.decode, "decode"),
                                    (policy.pick_prefill, view.prefill, "prefill")):
            vector_used += policy._vector(workers, role, matches) is not None
            state = policy.rng.getstate()
            got, got_cost = pick(req, workers, matches)
            policy.rng.setstate(state)
            want, want_cost = pick(req, list(workers), dict(matches))   # not the synced view: Python scan
            assert (got.worker_id, got_cost) == (want.worker_id, want_cost), step
        router.route(req)                                               # moves pending loads on
    assert vector_used > 1100, vector_used


def test_small_pools_use_the_python_scan():
    small = _router(14)                                # 7 a role
    assert small.view and small.policy._synced is None
    listed = _router(100)
    assert listed.view and listed.policy._synced is listed.view and len(listed.policy._roles["decode"]) <= 64
    big = _router(160)
    assert big.view and big.policy._synced is big.view
    warm = _router(160, temperature=0.5)
    assert warm.view and warm.policy._synced is warm.view
    assert isinstance(big.policy._roles["decode"].keys, np.ndarray)


def test_member_positions_by_byte_equal_the_bit_walk():
    """Positions read a byte of the mask at a time (tables per byte) are the bit
    walk's, in its order, for masks over many bytes and non-member bits."""
    rng = random.Random(3)
    ids = [f"w{i:03d}" for i in range(150)]
    members = [WorkerView(w, "prefill", WorkerLoad(queued_prefill_tokens=i)) for i, w in enumerate(ids) if i % 3]
    members.sort(key=lambda v: v.worker_id[::-1])         # positions in another order than bits
    rc = RoleCosts(members, lambda load: float(load.queued_prefill_tokens))
    for _ in range(300):
        mask = rng.getrandbits(150) & rng.getrandbits(150) if rng.random() < 0.5 else 1 << rng.randrange(150)
        assert rc.member_positions(mask, ids) == tuple(rc._walk_bits(mask, ids))

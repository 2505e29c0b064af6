"""The router's C tables (cluster/router/native.py) against the pure-Python paths
they replace: the same matches on random indexes fed as the engine feeds them
(removals, tier moves, parentless stores, snapshots, CLEARED, dead workers), the
same in-flight answers under random sends, evictions, drops and ageing, and the
fallbacks (a hash that is not 64-bit, the table switched off)."""
from __future__ import annotations

import random

import pytest

from cluster.router import native
from cluster.router.inflight import InFlightMatch, InFlightPrefixes
from cluster.router.index import PrefixIndex
from engine.kv_events import KVEvent, KVEventKind, Tier
from test_router_index_search import _chains, _Feed, reference_match

pytestmark = pytest.mark.skipif(native.module() is None, reason="no C compiler: the Python paths serve")


class _Both(_Feed):
    """One feed applied to a native index and a pure-Python one."""

    def __init__(self, rng: random.Random, workers: list[str]) -> None:
        super().__init__(rng, PrefixIndex(), workers)
        self.py = PrefixIndex(use_native=False)
        apply, resync, remove = self.idx.apply, self.idx.resync, self.idx.remove_worker

        def both_apply(w, events):
            self.py.apply(w, events)
            return apply(w, events)

        def both_resync(w, snap):
            self.py.resync(w, snap)
            resync(w, snap)

        def both_remove(w):
            self.py.remove_worker(w)
            remove(w)

        self.idx.apply, self.idx.resync, self.idx.remove_worker = both_apply, both_resync, both_remove  # type: ignore[method-assign]


def check_mirror(idx: PrefixIndex) -> None:
    table = idx._native
    assert table is not None and len(table) == len(idx._held)
    assert all(table.get(h) == v for h, v in idx._held.items())


@pytest.mark.parametrize("seed", range(4))
def test_the_c_walk_equals_the_python_search_and_a_plain_scan(seed):
    rng = random.Random(seed)
    feed = _Both(rng, [f"w{i}" for i in range(5 if seed % 2 else 64)])   # 64: every bit of the lane
    chains = _chains(rng)
    for step in range(300):
        feed.step(chains)
        if step % 50 == 0:
            check_mirror(feed.idx)
        for chain in rng.sample(chains, 3):
            cut = rng.randrange(len(chain)) if rng.random() < 0.2 else 0
            prompt = chain[cut:rng.randint(cut + 1, len(chain))]
            got = feed.idx.match(prompt)
            assert got == reference_match(feed.model, prompt) == feed.py.match(prompt), (seed, step)
            lengths = [info.blocks for _, info in got.groups]
            assert lengths == sorted(lengths)                   # groups in the order the search emits
    check_mirror(feed.idx)


def test_the_block_table_through_its_doublings_mirrors_the_index():
    """120k blocks stored by three workers, some removed between, take the block table
    (csrc/blocktable.c, at most 0.8 full) from 1,024 to 2**18 slots; the mirror and every walk
    stay equal to the Python index."""
    rng = random.Random(4)
    idx, py = PrefixIndex(), PrefixIndex(use_native=False)
    table = idx._native
    assert table is not None
    chains: list[tuple[int, ...]] = []
    event_ids = {"w0": 0, "w1": 0, "w2": 0}                 # each worker's events numbered without gaps
    for step in range(4_000):
        w = rng.choice(("w0", "w1", "w2"))
        base = chains[rng.randrange(len(chains))][:rng.randint(1, 10)] if chains and rng.random() < 0.3 else ()
        chain = base + tuple(rng.getrandbits(63) for _ in range(30))
        event_ids[w] += 1
        events = [KVEvent(event_ids[w], KVEventKind.STORED, chain, None, Tier.DEVICE)]
        if step % 7 == 0 and chains:
            event_ids[w] += 1
            events.append(KVEvent(event_ids[w], KVEventKind.REMOVED, rng.choice(chains)[-5:], None, Tier.DEVICE))
        for i in (idx, py):
            assert not i.apply(w, events).needs_resync
        chains.append(chain)
    assert 0.4 * 2**18 < len(table) < 0.8 * 2**18 and table.nbytes() == 2**18 * 32     # slots of 32 bytes
    check_mirror(idx)
    for chain in rng.sample(chains, 300):
        prompt = list(chain[:rng.randint(1, len(chain))])
        assert idx.match(prompt) == py.match(prompt)


def test_a_65th_worker_or_a_wide_hash_turns_the_table_off_and_answers_stay_right():
    idx = PrefixIndex()
    for i in range(64):
        idx.apply(f"w{i}", [KVEvent(1, KVEventKind.STORED, (1, 2), None, Tier.DEVICE)])
    assert idx._native is not None and idx.match([1, 2, 3])["w63"].blocks == 2
    idx.apply("w64", [KVEvent(1, KVEventKind.STORED, (1,), None, Tier.HOST)])       # lanes widen
    assert idx._native is None and idx.match([1, 2])["w64"].host_blocks == 1
    wide = PrefixIndex()
    wide.apply("a", [KVEvent(1, KVEventKind.STORED, (5, 2**70), None, Tier.DEVICE)])
    assert wide._native is None and wide.match([5, 2**70])["a"].blocks == 2


def _same(a: InFlightPrefixes, b: InFlightPrefixes, prompt, now) -> None:
    assert a.match(prompt, now) == b.match(prompt, now)


@pytest.mark.parametrize("seed", range(3))
def test_the_c_in_flight_table_answers_as_the_dicts(seed):
    rng = random.Random(seed)
    c, py = InFlightPrefixes(1.0), InFlightPrefixes(1.0, use_native=False)
    assert c.native and not py.native
    chains = _chains(rng)
    workers = ["p0", "p1", "p2"]
    now = 0.0
    for step in range(600):
        now += rng.choice((0.0, 0.01, 0.05, 0.3, 1.2))
        chain, w, roll = rng.choice(chains), rng.choice(workers), rng.random()
        if roll < 0.45:
            n = rng.randint(1, len(chain))
            for f in (c, py):
                f.record(w, chain[:n], now)
        elif roll < 0.55:                       # a pending send kept alive (sends.py)
            n = rng.randint(1, len(chain))
            for f in (c, py):
                f.refresh(w, chain[:n], now)
        elif roll < 0.7:
            gone = rng.sample(chain, rng.randint(1, len(chain)))
            for f in (c, py):
                f.on_removed(w, iter(gone) if rng.random() < 0.5 else gone)
        elif roll < 0.75:
            for f in (c, py):
                f.drop_worker(w)
        for prompt in rng.sample(chains, 2):
            _same(c, py, prompt, now)
        assert len(c) == len(py), step
    assert c.native


def test_a_hash_the_table_cannot_hold_moves_its_entries_to_the_dicts():
    c, py = InFlightPrefixes(10.0), InFlightPrefixes(10.0, use_native=False)
    for f in (c, py):
        f.record("p0", (1, 2, 3), 0.0)
        f.drop_worker("p1")
        f.record("p1", (1, 2), 0.5)
        f.record("p2", (2**64, 7), 1.0)
    assert not c.native and len(c) == len(py) == 5
    for prompt in ((1, 2, 3), (2**64, 7), (3,), (2,)):
        assert c.match(prompt, 2.0) == py.match(prompt, 2.0)
    assert c.match((1, 2, 3), 2.0) == InFlightMatch("p0", 3)
    assert c.match((1, 2), 2.0) == InFlightMatch("p1", 2)


def test_the_table_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("PDSERVE_ROUTER_NATIVE", "0")
    native.module.cache_clear()
    try:
        assert PrefixIndex()._native is None and not InFlightPrefixes(1.0).native
    finally:
        monkeypatch.delenv("PDSERVE_ROUTER_NATIVE")
        native.module.cache_clear()
    assert PrefixIndex()._native is not None


def test_the_in_flight_table_grown_into_prepared_arrays_answers_as_the_dicts():
    """Past 2**15 slots the C table doubles into an array a helper thread made ready
    (csrc/prepare.c): 60k random sends of up to 8 blocks take it through three such
    doublings and a new generation, with removals between them."""
    rng = random.Random(7)
    c, py = InFlightPrefixes(1.0), InFlightPrefixes(1.0, use_native=False)
    sent: list[tuple[int, ...]] = []
    for step in range(60_000):
        now = step / 40_000                       # one generation change, at step 40k
        chain = tuple(rng.getrandbits(64) for _ in range(rng.randint(1, 8)))
        w = rng.choice(("p0", "p1"))
        for f in (c, py):
            f.record(w, chain, now)
        sent.append(chain)
        if step % 97 == 0:
            gone = rng.choice(sent)
            for f in (c, py):
                f.on_removed(w, gone)
        if step % 10_000 == 9_999:
            assert len(c) == len(py), step
            for prompt in rng.sample(sent, 300):
                _same(c, py, prompt, now)
    assert c.native and len(c) > 150_000


def test_while_a_doubling_runs_off_the_routing_thread_the_table_answers_as_the_dicts():
    """Past 2**15 slots the current generation doubles on a helper thread (csrc/inflight.c):
    meanwhile it is read-only and writes go to a delta laid over it (a removal there a tombstone).
    Sends, refreshes of earlier sends, evictions of their blocks and re-sends of evicted ones,
    with every answer compared to the dicts while a doubling runs; len and the dump once it ends."""
    rng = random.Random(5)
    c, py = InFlightPrefixes(10.0), InFlightPrefixes(10.0, use_native=False)
    table = c.table
    assert table is not None
    sent: list[tuple[int, ...]] = []
    during, now = 0, 0.0
    for step in range(40_000):
        now = step * 1e-4                          # 4 s: one generation
        w = rng.choice(("p0", "p1", "p2"))
        roll = rng.random()
        if roll < 0.7 or len(sent) < 10:
            chain = tuple(rng.getrandbits(64) for _ in range(rng.randint(1, 12)))
            if sent and rng.random() < 0.3:        # a later turn: an earlier send's chain extended
                chain = rng.choice(sent) + chain
            for f in (c, py):
                f.record(w, chain, now)
            sent.append(chain)
        elif roll < 0.8:                           # a pending send kept alive (sends.py)
            chain = rng.choice(sent)
            for f in (c, py):
                f.refresh(w, chain, now)
        elif roll < 0.9:                           # evicted blocks, some owned by w
            chain = rng.choice(sent)
            gone = rng.sample(chain, rng.randint(1, len(chain)))
            for f in (c, py):
                f.on_removed(w, gone)
        else:                                      # an evicted chain sent again
            chain, again = rng.choice(sent), rng.choice(("p0", "p1", "p2"))
            for f in (c, py):
                f.on_removed(w, chain)
                f.record(again, chain, now)
        if table.doubling():
            during += 1
            for prompt in rng.sample(sent, 3):
                _same(c, py, prompt, now)
    assert during >= 50                            # steps taken while the helper was at work (~200 here)
    assert len(c) == len(py) and not table.doubling()     # len() ends a doubling under way
    assert {h: (w, e, x) for h, w, e, x in table.dump()[0]} == {
        h: (c.number(w), e, x) for h, (w, e, x) in py._cur.items()}


def test_a_new_generation_while_a_doubling_runs_keeps_every_answer():
    """A generation that ends while the helper is still doubling cur is not waited for: the
    helper stops, the delta is laid over cur, which becomes the previous generation as it is."""
    rng = random.Random(9)
    c, py = InFlightPrefixes(10.0), InFlightPrefixes(10.0, use_native=False)
    table = c.table
    assert table is not None
    for f in (c, py):
        f.record("p0", (1,), 0.0)                  # the generation starts at 0
    sent: list[tuple[int, ...]] = []
    recorded = 0
    while not (recorded > 70_000 and table.doubling()):    # the 2**17-slot cur's doubling under way
        chain, w = tuple(rng.getrandbits(64) for _ in range(8)), rng.choice(("p0", "p1"))
        for f in (c, py):
            f.record(w, chain, 5.0)
        sent.append(chain)
        recorded += 8
    for chain in rng.sample(sent, 20):             # written to the delta: evictions and refreshes
        for f in (c, py):
            f.on_removed("p0", chain[:4])
            f.refresh("p1", chain, 6.0)
    assert table.doubling()
    for f in (c, py):
        f.record("p1", (2, 3), 10.0)               # a new generation: cur becomes prev
    assert not table.doubling()
    for prompt in rng.sample(sent, 500) + [(2, 3), (1,)]:
        _same(c, py, prompt, 10.0)
    assert len(c) == len(py)


def test_the_in_flight_table_doubles_before_it_is_half_full_and_counts_its_bytes():
    """A record probes until the hash's slot or a free one (csrc/inflight.c fg_slot): the table
    doubles before a send would fill it past half, so a probe for a new hash is short. nbytes()
    counts both generations' slots (and, past 2**15 slots, the array made ready for the next
    doubling: router_overhead.py reports it as the price of that speed)."""
    slot = 24                                     # FSlot: hash, expiry, worker, epoch
    f = InFlightPrefixes(10.0)
    table = f.table
    assert table is not None and table.nbytes() == 2 * 2**10 * slot     # two empty 1,024-slot generations
    rng = random.Random(3)
    chains = [tuple(rng.getrandbits(64) for _ in range(8)) for _ in range(65)]
    for chain in chains[:63]:
        f.record("p0", chain, 0.0)
    f.record("p1", chains[5][:3], 0.0)            # the same hashes again: overwritten in place
    f.record("p0", chains[63], 0.0)
    assert len(f) == 512 and table.nbytes() == 2 * 2**10 * slot         # 512 of 1,024: half, not past
    f.record("p0", chains[64], 0.0)
    assert len(f) == 520 and table.nbytes() == (2**11 + 2**10) * slot   # doubled (3/4 full would not)
    assert f.match(chains[5], 1.0) == InFlightMatch("p0", 8)
    assert f.match(chains[5][:3], 1.0) == InFlightMatch("p1", 3)
    f.refresh("p1", chains[5][:4], 2.0)           # a live entry keeps its owner, a refresh adds nothing
    assert len(f) == 520 and f.match(chains[5][:4], 2.0) == InFlightMatch("p0", 4)


@pytest.mark.parametrize("native_table", [True, False])
def test_a_refresh_keeps_owners_and_lives_a_ttl_from_now_in_c_and_in_the_dicts(native_table):
    """InFlightPrefixes.refresh (sends.py keeps a pending send alive): live entries keep their
    owner and live a ttl from the refresh, in cur or copied from prev; lapsed ones become the
    refreshing send's. The C table and the dicts the same, step by step."""
    f = InFlightPrefixes(1.0, use_native=native_table)
    assert f.native == native_table
    f.record("p9", (99,), 0.0)                   # the generation starts at 0
    f.record("p0", (1, 2, 3, 4), 0.5)            # expires at 1.5
    f.record("p1", (1, 2), 0.6)                  # a later send to another node owns 1, 2
    f.refresh("p0", (1, 2, 3, 4), 0.9)           # in cur: extended to 1.9, owners kept
    assert f.match((1, 2, 3, 4), 1.8) == InFlightMatch("p0", 4)     # (a new generation from 1.8)
    assert f.match((1, 2), 1.8) == InFlightMatch("p1", 2)
    f.refresh("p0", (1, 2, 3, 4), 1.85)          # prev's live entries copied into cur, to 2.85
    assert f.match((1, 2, 3, 4), 2.8) == InFlightMatch("p0", 4)
    assert f.match((1, 2), 2.8) == InFlightMatch("p1", 2)
    assert f.match((1, 2, 3, 4), 2.9) is None
    f.refresh("p0", (1, 2, 3, 4), 3.0)           # all lapsed: written back as p0's
    assert f.match((1, 2), 3.5) == InFlightMatch("p0", 2)
    f.drop_worker("p0")
    f.refresh("p1", (1, 2), 3.6)                 # stale entries (p0's old epoch): p1's now
    assert f.match((1, 2, 3, 4), 3.7) == InFlightMatch("p1", 2)


def test_a_new_generation_starts_in_an_array_sized_from_the_last_one():
    """Half-way through a generation the array the next one starts in is made ready (csrc/inflight.c
    ft_prepare_fresh), sized so twice what the current one holds then fits at most half full; the
    next generation, taking as many sends, then records them without doubling (starting again at
    1,024 slots it doubled six times, each a rehash in the decision that filled it)."""
    slot = 24
    rng = random.Random(11)
    f = InFlightPrefixes(10.0)
    table = f.table
    assert table is not None

    def one_generation(start: float) -> None:
        for i in range(2_000):                     # 2,000 sends of 10 blocks over 8 s
            f.record("p0", tuple(rng.getrandbits(64) for _ in range(10)), start + i * 0.004)

    one_generation(0.0)                            # 20,000 entries; past 5 s the next array is made at 10,000
    assert len(f) == 20_000                        # (len() settles a doubling still on the helper thread)
    cur = 2**16                                    # 20,000 entries at most half full
    fresh = 2**16                                  # 4 x 10,000 -> 65,536 slots
    assert table.nbytes() >= (cur + 2**10 + fresh) * slot
    chain = tuple(rng.getrandbits(64) for _ in range(10))
    f.record("p1", chain, 10.0)                    # a new generation: cur is the array made ready
    after_rotation = table.nbytes()
    # cur: the 65,536 made ready; prev: the last cur; the array made ready for a doubling of that
    # size (131,072), kept: it suits the new cur too
    assert after_rotation == (fresh + cur + 2 * cur) * slot
    one_generation(10.004)                         # as many again (until 18 s): no doubling,
    assert table.nbytes() == after_rotation + fresh * slot      # only the next generation's array
    assert f.match(chain, 18.0) == InFlightMatch("p1", 10)
    assert len(f) == 20_000 + 10 + 20_000

"""PrefixIndex.match's binary search over a prompt's chain against a plain scan of
every block, on randomized indexes fed as the engine feeds them (STORED runs with
their parent hash), with removals that break prefix closure, tier moves, parentless
stores, snapshots, CLEARED and dead workers."""
from __future__ import annotations

import random

import pytest

from cluster.router.index import MatchInfo, PrefixIndex
from engine.block_hash import block_hashes, root_hash
from engine.kv_events import KVEvent, KVEventKind, KVSnapshot, Tier

S, R, CL = KVEventKind.STORED, KVEventKind.REMOVED, KVEventKind.CLEARED
TIERS = (Tier.DEVICE, Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.DISK)
ROOT = root_hash(None)


def reference_match(model: dict[str, dict[int, Tier]], hashes) -> dict[str, MatchInfo]:
    """Per worker: its leading blocks of ``hashes``, counted by tier (a plain scan)."""
    out = {}
    for w, blocks in model.items():
        n = 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        if n:
            tiers = [blocks[h] for h in hashes[:n]]
            out[w] = MatchInfo(tiers.count(Tier.DEVICE), tiers.count(Tier.HOST), tiers.count(Tier.DISK))
    return out


def _chains(rng: random.Random) -> list[list[int]]:
    """Prompts sharing a few system prefixes, as chained block hashes."""
    systems = [[rng.randrange(50_000) for _ in range(16 * rng.randint(1, 4))] for _ in range(3)]
    chains = []
    for _ in range(12):
        tokens = rng.choice(systems) + [rng.randrange(50_000) for _ in range(16 * rng.randint(0, 8))]
        chains.append(block_hashes(tokens, 16))
    return chains


class _Feed:
    """Random events for a few workers, applied to the index and to a plain model."""

    def __init__(self, rng: random.Random, idx: PrefixIndex, workers: list[str]) -> None:
        self.rng, self.idx = rng, idx
        self.model: dict[str, dict[int, Tier]] = {w: {} for w in workers}
        self.next_id = {w: 1 for w in workers}

    def send(self, w: str, kind: KVEventKind, hashes=(), parent=None, tier=Tier.DEVICE) -> None:
        res = self.idx.apply(w, [KVEvent(self.next_id[w], kind, tuple(hashes), parent, tier)])
        assert res.applied == 1 and not res.needs_resync
        self.next_id[w] += 1
        if kind is S:
            self.model[w].update(dict.fromkeys(hashes, tier))
        elif kind is R:
            for h in hashes:
                self.model[w].pop(h, None)
        else:
            self.model[w] = {}

    def step(self, chains: list[list[int]]) -> None:
        rng, w = self.rng, self.rng.choice(list(self.model))
        chain = rng.choice(chains)
        roll = rng.random()
        if roll < 0.45:                        # a run of a chain with its parent (the engine's protocol)
            a = 0 if rng.random() < 0.7 else rng.randrange(len(chain))
            b = rng.randint(a + 1, len(chain))
            self.send(w, S, chain[a:b], chain[a - 1] if a else ROOT, rng.choice(TIERS))
        elif roll < 0.55:                      # parentless: a producer that does not say
            picks = rng.sample(chain, rng.randint(1, min(3, len(chain))))
            self.send(w, S, picks, None, rng.choice(TIERS))
        elif roll < 0.85:                      # evict: tail first, or anywhere (breaks prefix closure)
            held = [h for h in chain if h in self.model[w]]
            if held:
                gone = held[-rng.randint(1, len(held)):] if rng.random() < 0.5 else rng.sample(held, 1)
                self.send(w, R, gone)
        elif roll < 0.9:
            self.send(w, CL)
        elif roll < 0.95:                      # dead, then back through a snapshot (no parents)
            self.idx.remove_worker(w)
            keep = {h: t for h, t in self.model[w].items() if rng.random() < 0.8}
            by_tier: dict[Tier, list[int]] = {}
            for h, t in keep.items():
                by_tier.setdefault(t, []).append(h)
            self.idx.resync(w, KVSnapshot(self.next_id[w] - 1, {t: tuple(v) for t, v in by_tier.items()}))
            self.model[w] = keep
        else:
            self.idx.remove_worker(w)
            self.model[w], self.next_id[w] = {}, 1


def check_shape(idx: PrefixIndex) -> None:
    """The index's chain bookkeeping equals a recount from its blocks and parents."""
    risky: dict[int, int] = {}
    for w in idx._workers.values():
        kids: dict[int, int] = {}
        for h in w.blocks:
            if h in w.unparented:
                risky[h] = risky.get(h, 0) | w.bit
            else:
                kids[idx._parent[h]] = kids.get(idx._parent[h], 0) + 1
        assert w.kids == kids and w.unparented <= w.blocks.keys()
        for q in kids:
            if q not in w.blocks:
                risky[q] = risky.get(q, 0) | w.bit
    assert idx._risky == risky
    lane = idx._lane
    special = {h: v >> lane for h, v in idx._held.items() if v >> lane}
    for h, m in risky.items():
        special[h] = special.get(h, 0) | m << 2 * lane
    assert idx._special == special
    assert idx._parent.keys() <= idx._held.keys()


@pytest.mark.parametrize("seed", range(12))
def test_search_equals_a_plain_scan_on_random_indexes(seed):
    rng = random.Random(seed)
    idx = PrefixIndex(use_native=False)            # the Python search (test_router_native.py: the C walk)
    feed = _Feed(rng, idx, [f"w{i}" for i in range(5 if seed % 2 else 70)])   # 70: wider lanes
    chains = _chains(rng)
    walks = [0]
    walk = idx._walk

    def counting_walk(*a):
        walks[0] += 1
        return walk(*a)

    idx._walk = counting_walk                  # type: ignore[method-assign]
    queries = 0
    for step in range(400):
        feed.step(chains)
        if step % 40 == 0:
            check_shape(idx)
        for chain in rng.sample(chains, 3):
            cut = rng.randrange(len(chain)) if rng.random() < 0.2 else 0
            prompt = chain[cut:rng.randint(cut + 1, len(chain))]
            assert idx.match(prompt) == reference_match(feed.model, prompt), (seed, step)
            queries += 1
    assert walks[0] < queries * 0.7, (walks[0], queries)      # the search answered many of them
    check_shape(idx)


def test_a_hole_in_an_engine_fed_chain_is_seen_and_refilling_it_clears_it():
    chain = block_hashes(list(range(160)), 16)
    idx = PrefixIndex()
    idx.apply("a", [KVEvent(1, S, tuple(chain), ROOT)])
    assert idx.match(chain) == {"a": MatchInfo(10)}
    assert not idx._risky.keys() - {ROOT}
    idx.apply("a", [KVEvent(2, R, (chain[3],))])
    assert chain[3] in idx._risky                           # a holds children of block 3, not 3
    assert idx.match(chain) == {"a": MatchInfo(3)}
    idx.apply("a", [KVEvent(3, S, (chain[3],), chain[2], Tier.HOST)])
    assert chain[3] not in idx._risky
    assert idx.match(chain) == {"a": MatchInfo(9, 1)}
    idx.apply("a", [KVEvent(4, CL)])
    assert not idx._risky and not idx._special and not idx._parent


def test_length_hints_are_only_guesses():
    """A group's match-length hint (learned, or seeded by a STORED run) that no
    longer holds, or never did, changes nothing: the answer is the plain scan's."""
    idx = PrefixIndex(use_native=False)
    feed = _Feed(random.Random(0), idx, ["a", "b"])
    chain = block_hashes(list(range(16 * 12)), 16)
    feed.send("a", S, chain[:8], ROOT)                  # a run of 8: seeds the hint 8 at chain[0]
    feed.send("b", S, chain[:3], ROOT)
    for prompt in (chain, chain[:5], chain[:8], chain[:9]):
        assert idx.match(prompt) == reference_match(feed.model, prompt)
    feed.send("a", R, chain[5:8][::-1])                 # shorter than every hint now
    feed.send("b", S, chain[3:10], chain[2], Tier.HOST)     # longer, partly off device
    for start, length in ((0, 1), (0, 12), (3, 2), (3, 40)):
        idx._hints[chain[start]] = length               # wrong on purpose
        for prompt in (chain, chain[:4], chain[:7], chain[:10]):
            assert idx.match(prompt) == reference_match(feed.model, prompt), (start, length, len(prompt))

"""PrefixIndex: events, gaps, resync, removal, tiers, and a model-based property test."""
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.router.index import MatchInfo, PrefixIndex
from engine.block_hash import block_hashes
from engine.kv_events import KVEvent, KVEventKind, KVSnapshot, Tier
from test_router_index_search import reference_match

S, R, CL = KVEventKind.STORED, KVEventKind.REMOVED, KVEventKind.CLEARED
TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)
CHAIN = block_hashes(list(range(160)), 16)          # 10 chained block hashes
OTHER = block_hashes(list(range(1000, 1160)), 16)   # an unrelated prompt


def stored(i, hashes, tier=Tier.DEVICE, parent=None):
    return KVEvent(i, S, tuple(hashes), parent, tier)


def test_match_counts_leading_blocks_per_worker():
    idx = PrefixIndex()
    assert idx.apply("a", [stored(1, CHAIN[:6])]).applied == 1
    idx.apply("b", [stored(1, CHAIN[:2]), stored(2, OTHER[:4])])
    idx.apply("c", [stored(1, OTHER)])
    assert idx.match(CHAIN) == {"a": MatchInfo(6), "b": MatchInfo(2)}
    assert idx.match(CHAIN[:1]) == {"a": MatchInfo(1), "b": MatchInfo(1)}
    assert idx.match(OTHER[:5]) == {"b": MatchInfo(4), "c": MatchInfo(5)}
    assert idx.match([]) == {}
    assert idx.match([12345]) == {}


def test_match_is_the_leading_prefix_not_the_deepest_block():
    idx = PrefixIndex()
    idx.apply("a", [stored(1, CHAIN), KVEvent(2, R, (CHAIN[3],))])
    # a holds blocks 0-2 and 4-9 but lost block 3: its usable prefix is 3 blocks
    assert idx.match(CHAIN) == {"a": MatchInfo(3)}
    idx.apply("a", [KVEvent(3, R, (CHAIN[0],))])
    assert idx.match(CHAIN) == {}


def test_tiers_are_counted_apart_and_a_stored_moves_a_block():
    idx = PrefixIndex()
    idx.apply("a", [stored(1, CHAIN[:4]), stored(2, CHAIN[4:6], Tier.HOST), stored(3, CHAIN[6:7], Tier.DISK)])
    assert idx.match(CHAIN) == {"a": MatchInfo(device_blocks=4, host_blocks=2, disk_blocks=1)}
    assert idx.match(CHAIN).get("a").blocks == 7
    # demotion device -> host, then promotion back
    idx.apply("a", [stored(4, CHAIN[:1], Tier.HOST)])
    assert idx.match(CHAIN)["a"] == MatchInfo(3, 3, 1)
    idx.apply("a", [stored(5, CHAIN[:1], Tier.DEVICE), stored(6, CHAIN[4:5], Tier.DEVICE)])
    assert idx.match(CHAIN)["a"] == MatchInfo(5, 1, 1)
    # REMOVED drops a block from every tier
    idx.apply("a", [KVEvent(7, R, (CHAIN[5],))])
    assert idx.match(CHAIN)["a"] == MatchInfo(5, 0, 0)


def test_tier_counts_cover_only_the_matched_prefix():
    idx = PrefixIndex()
    idx.apply("a", [stored(1, CHAIN[:2]), stored(2, CHAIN[3:5], Tier.HOST)])
    idx.apply("b", [stored(1, CHAIN[:5], Tier.HOST)])
    assert idx.match(CHAIN) == {"a": MatchInfo(2), "b": MatchInfo(0, 5, 0)}


def test_cleared_drops_only_that_worker():
    idx = PrefixIndex()
    idx.apply("a", [stored(1, CHAIN)])
    idx.apply("b", [stored(1, CHAIN[:3])])
    idx.apply("a", [KVEvent(2, CL)])
    assert idx.match(CHAIN) == {"b": MatchInfo(3)}
    assert idx.num_entries == 3 and idx.num_unique_blocks == 3


def test_duplicates_are_skipped():
    idx = PrefixIndex()
    idx.apply("a", [stored(1, CHAIN[:2]), stored(2, CHAIN[2:4])])
    res = idx.apply("a", [stored(2, CHAIN[2:4]), KVEvent(1, R, (CHAIN[0],)), stored(3, CHAIN[4:5])])
    assert (res.applied, res.duplicates, res.needs_resync) == (1, 2, False)
    assert idx.match(CHAIN) == {"a": MatchInfo(5)}
    assert idx.last_event_id("a") == 3


def test_gap_marks_resync_and_drops_events_until_snapshot():
    idx = PrefixIndex()
    idx.apply("a", [stored(1, CHAIN[:2])])
    res = idx.apply("a", [stored(2, CHAIN[2:3]), stored(4, CHAIN[3:5])])
    assert res.needs_resync and res.applied == 1
    assert (res.expected_event_id, res.received_event_id) == (3, 4)
    assert idx.needs_resync("a")
    # still flagged, further events ignored (stale entries kept meanwhile)
    again = idx.apply("a", [stored(3, CHAIN[3:4])])
    assert again.needs_resync and again.applied == 0
    assert idx.match(CHAIN) == {"a": MatchInfo(3)}
    idx.resync("a", KVSnapshot(last_event_id=10, blocks={Tier.DEVICE: tuple(CHAIN[:6]),
                                                         Tier.HOST: tuple(CHAIN[6:8])}))
    assert not idx.needs_resync("a")
    assert idx.match(CHAIN) == {"a": MatchInfo(6, 2, 0)}
    # events already in the snapshot are duplicates; the next one applies
    res = idx.apply("a", [stored(10, OTHER), stored(11, CHAIN[9:10])])
    assert (res.applied, res.duplicates) == (1, 1)
    assert idx.match(CHAIN) == {"a": MatchInfo(6, 2, 0)}
    assert idx.match(OTHER) == {}


def test_snapshot_with_a_block_in_two_tiers_keeps_the_fastest():
    idx = PrefixIndex()
    idx.resync("a", KVSnapshot(0, {Tier.HOST: tuple(CHAIN[:3]), Tier.DEVICE: tuple(CHAIN[:2]),
                                   Tier.DISK: tuple(CHAIN[:4])}))
    assert idx.match(CHAIN) == {"a": MatchInfo(2, 1, 1)}
    assert idx.apply("a", [stored(1, CHAIN[4:5])]).applied == 1


def test_new_worker_must_start_at_the_first_event_id():
    idx = PrefixIndex()
    res = idx.apply("a", [stored(5, CHAIN)])
    assert res.needs_resync and res.expected_event_id == 1
    assert idx.match(CHAIN) == {}
    assert PrefixIndex(first_event_id=0).apply("a", [stored(0, CHAIN)]).applied == 1


def test_removed_worker_is_dropped_until_it_reports_again():
    idx = PrefixIndex()
    idx.apply("a", [stored(1, CHAIN)])
    idx.apply("b", [stored(1, CHAIN[:4])])
    idx.remove_worker("a")
    idx.remove_worker("a")   # idempotent
    assert idx.match(CHAIN) == {"b": MatchInfo(4)}
    assert idx.worker_ids == ("b",)
    assert idx.num_unique_blocks == 4
    # a restarted worker counts events from the start again
    assert idx.apply("a", [stored(1, CHAIN[:1])]).applied == 1
    assert idx.match(CHAIN) == {"a": MatchInfo(1), "b": MatchInfo(4)}
    # one that reappears mid-stream must resync
    idx.remove_worker("b")
    assert idx.apply("b", [stored(9, CHAIN)]).needs_resync


def test_many_workers_distinct_prefix_lengths():
    idx = PrefixIndex()
    for k in range(1, 11):
        idx.apply(f"w{k:02d}", [stored(1, CHAIN[:k])])
    got = idx.match(CHAIN)
    assert got == {f"w{k:02d}": MatchInfo(k) for k in range(1, 11)}


def test_many_workers_with_mixed_tiers_match_brute_force():
    # 150 workers: more than one 64-bit lane, so the packed masks are re-encoded twice
    import random
    rng = random.Random(5)
    chain = block_hashes(list(range(40 * 16)), 16)
    idx, model = PrefixIndex(), {}
    for k in range(150):
        wid = f"w{k:03d}"
        n = rng.randint(1, 40)
        tiers = [rng.choice(TIERS) for _ in range(n)]
        idx.apply(wid, [stored(i + 1, [h], t) for i, (h, t) in enumerate(zip(chain, tiers))])
        model[wid] = dict(zip(chain, tiers))
    assert idx.match(chain) == reference_match(model, chain)
    assert idx.match(chain[:17]) == reference_match(model, chain[:17])
    for k in range(0, 150, 3):                     # demote, promote and drop after widening
        wid = f"w{k:03d}"
        h = chain[k % 5]
        if h in model[wid]:
            tier = TIERS[k % 3]
            assert idx.apply(wid, [stored(len(model[wid]) + 1, [h], tier)]).applied == 1
            model[wid][h] = tier
        idx.remove_worker(f"w{k + 1:03d}")
        model[f"w{k + 1:03d}"] = {}
    assert idx.match(chain) == reference_match(model, chain)


# ---- model-based property test ---------------------------------------------
WORKERS = ("a", "b", "c")
TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)
# a small universe: two chains of 6 blocks sharing no hash
UNIVERSE = CHAIN[:6] + OTHER[:6]

event_st = st.one_of(
    st.tuples(st.just(S), st.lists(st.sampled_from(UNIVERSE), max_size=6), st.sampled_from(TIERS)),
    st.tuples(st.just(R), st.lists(st.sampled_from(UNIVERSE), max_size=6), st.just(Tier.DEVICE)),
    st.tuples(st.just(CL), st.just([]), st.just(Tier.DEVICE)),
)
op_st = st.one_of(
    st.tuples(st.just("event"), st.sampled_from(WORKERS), event_st),
    st.tuples(st.just("remove"), st.sampled_from(WORKERS), st.none()),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op_st, max_size=40), st.integers(0, 5))
def test_index_equals_brute_force_model(ops, cut):
    idx = PrefixIndex()
    model = {w: {} for w in WORKERS}
    next_id = {w: 1 for w in WORKERS}
    for op, w, payload in ops:
        if op == "remove":
            idx.remove_worker(w)
            model[w] = {}
            next_id[w] = 1
            continue
        kind, hashes, tier = payload
        res = idx.apply(w, [KVEvent(next_id[w], kind, tuple(hashes), None, tier)])
        assert res.applied == 1 and not res.needs_resync
        next_id[w] += 1
        if kind is S:
            model[w].update({h: tier for h in hashes})
        elif kind is R:
            for h in hashes:
                model[w].pop(h, None)
        else:
            model[w] = {}
    for w in WORKERS:
        assert dict(idx.worker_blocks(w)) == model[w]
    assert idx.num_entries == sum(len(b) for b in model.values())
    assert idx.num_unique_blocks == len(set().union(*(b.keys() for b in model.values())))
    for prompt in (CHAIN[:6], OTHER[:6], CHAIN[cut:6]):
        assert idx.match(prompt) == reference_match(model, prompt)

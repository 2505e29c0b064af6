"""In-flight prefixes: what route() sent to a node counts there before its KV events arrive."""
import random

import pytest

from cluster.router import (CostWeights, InFlightMatch, InFlightPrefixes, MatchInfo, PolicyConfig, Router,
                            RouterConfig, RoutingRequest, WorkerLoad)
from cluster.router import cost as C
from engine.block_hash import block_hashes
from engine.kv_events import KVEvent, KVEventKind
from cluster.router.inflight import NoInFlightPrefixes

BS = 16
SYSTEM = list(range(384))                       # 24 shared blocks


def group_req(i, system=SYSTEM, question_len=32):
    tokens = system + [100_000 + 977 * i + t for t in range(question_len)]
    return RoutingRequest(f"q{i}", len(tokens), tuple(block_hashes(tokens, BS)), BS)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def router(clock=None, ttl=10.0):
    r = Router(RouterConfig(track_in_flight=True, policy_config=PolicyConfig(local_prefill_threshold=0, local_prefill_hit_ratio=1.0),
                            in_flight_ttl_s=ttl), rng=random.Random(0), clock=clock or Clock())
    for wid, pool in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        r.add_worker(wid, pool)
    return r


# ---- InFlightPrefixes on its own -------------------------------------------
def test_match_finds_the_deepest_block_sent_and_its_node():
    a, b = group_req(1).block_hashes, group_req(2).block_hashes
    f = InFlightPrefixes(10.0)
    assert f.match(a, 0.0) is None
    f.record("p0", a, 0.0)
    assert f.match(a, 1.0) == InFlightMatch("p0", 26)
    assert f.match(b, 1.0) == InFlightMatch("p0", 24)        # the shared system prompt only
    assert f.match(a[:5], 1.0) == InFlightMatch("p0", 5)
    assert f.match(tuple(block_hashes(list(range(5000, 5416)), BS)), 1.0) is None
    f.record("p1", b, 2.0)                                      # the last node sent a block owns it
    assert f.match(b, 3.0) == InFlightMatch("p1", 26)
    assert f.match(a, 3.0) == InFlightMatch("p0", 26)
    assert f.match(a[:24], 3.0) == InFlightMatch("p1", 24)


@pytest.mark.parametrize("n_sent", [1, 2, 3, 7, 8, 9, 24, 26])
def test_binary_search_equals_a_linear_scan(n_sent):
    a = group_req(1).block_hashes
    f = InFlightPrefixes(10.0)
    f.record("p0", a[:n_sent], 0.0)
    assert f.match(a, 0.5) == InFlightMatch("p0", n_sent)


def test_entries_expire_after_the_ttl_and_old_generations_are_dropped():
    a = group_req(1).block_hashes
    f = InFlightPrefixes(10.0)
    f.record("p0", a, 0.0)
    assert f.match(a, 9.9) == InFlightMatch("p0", 26)
    assert f.match(a, 10.0) is None
    f.record("p1", a[:3], 10.0)
    assert f.match(a, 15.0) == InFlightMatch("p1", 3)
    f.record("p1", a[:1], 35.0)                                 # two generations later: the rest is gone
    assert len(f) == 1


def test_removed_and_dropped_workers_lose_their_entries():
    a, b = group_req(1).block_hashes, group_req(2).block_hashes
    f = InFlightPrefixes(10.0)
    f.record("p0", a, 0.0)
    f.on_removed("p1", a)                                       # not the owner: no effect
    assert f.match(a, 1.0) == InFlightMatch("p0", 26)
    f.on_removed("p0", a[24:])
    assert f.match(a, 1.0) == InFlightMatch("p0", 24)
    f.drop_worker("p0")
    assert f.match(a, 1.0) is None
    f.record("p0", b, 2.0)                                      # sent again after the drop: counts
    assert f.match(b, 2.0) == InFlightMatch("p0", 26)


def test_ttl_must_be_positive():
    with pytest.raises(ValueError, match="ttl"):
        InFlightPrefixes(0)
    with pytest.raises(ValueError, match="in_flight_ttl_s"):
        RouterConfig(in_flight_ttl_s=-1)


# ---- the cost of an in-flight prefix ----------------------------------------
def test_in_flight_blocks_count_as_cached_and_offset_the_queue_computing_them():
    w = CostWeights()
    miss = w.uncached_token
    assert C.effective_cached_blocks(0, 0, 0, w, 24) == pytest.approx(0.9 * 24)
    # 26-block prompt, 24 blocks in flight on a node queueing 416 tokens (the request computing them)
    assert C.prefill_cost(26 - 0.9 * 24, 416, BS, w, 24) == pytest.approx(miss * (26 - 21.6) * 16 + 32)
    # more in flight than queued: the queue term does not go negative
    assert C.prefill_cost(2, 100, BS, w, 24) == pytest.approx(miss * 32)
    # without in-flight blocks the whole queue counts, as before
    assert C.prefill_cost(2, 416, BS, w) == pytest.approx(miss * 32 + 416)
    with pytest.raises(ValueError):
        C.prefill_cost(2, 0, BS, w, -1)
    with pytest.raises(ValueError, match="in_flight_hit"):
        CostWeights(in_flight_hit=1.5)


# ---- the Router --------------------------------------------------------------
# an idle pool ties: the group's first block hash picks where the tie starts (policy._tie_start)
HOME, AWAY = ("p0", "p1") if group_req(0).block_hashes[0] % 2 == 0 else ("p1", "p0")


def test_a_burst_of_same_prefix_requests_stays_on_one_prefill_node():
    r = router()
    chosen = [r.route(group_req(i)).prefill_worker_id for i in range(8)]
    assert chosen == [HOME] * 8
    second = r.route(group_req(8))
    assert second.prefill_inputs.match == MatchInfo(0, 0, 0, 24)
    assert second.prefill_cached_tokens == 24 * BS
    # a different group goes to the other node: HOME's queue holds the first group's work
    other = group_req(0, system=list(range(50_000, 50_384)))
    assert r.route(other).prefill_worker_id == AWAY


def test_the_burst_spills_once_the_queue_is_too_costly():
    r = router()
    assert r.route(group_req(0)).prefill_worker_id == HOME
    r.update_load(HOME, WorkerLoad(queued_prefill_tokens=3000))     # much more queued than the prefix
    assert r.route(group_req(1)).prefill_worker_id == AWAY
    # each follower adds its 32 uncached tokens to p0's queue: once that queue outweighs computing
    # the whole prompt on AWAY (6 x 416), AWAY is cheaper: HOME costs 6 x 4.4 x 16 + 32 k after k followers
    r = router()
    chosen = [r.route(group_req(i)).prefill_worker_id for i in range(80)]
    assert chosen[:65] == [HOME] * 65 and chosen[65] == AWAY


def test_in_flight_entries_lapse_and_die_with_the_worker():
    clock = Clock()
    r = router(clock=clock, ttl=2.0)
    assert r.route(group_req(0)).prefill_worker_id == HOME
    r.update_load(HOME, WorkerLoad(queued_prefill_tokens=416))
    assert r.on_prefill_end("q0")                                   # computed: no longer kept alive
    clock.t += 2.5                                                  # nothing reported: the entry lapsed
    assert r.route(group_req(1)).prefill_worker_id == AWAY
    r.update_load(AWAY, WorkerLoad(queued_prefill_tokens=416))
    r.on_worker_dead(AWAY)
    r.update_load(AWAY, WorkerLoad(queued_prefill_tokens=416))      # back, but it holds nothing
    r.update_load(HOME, WorkerLoad(queued_prefill_tokens=400))
    assert r.route(group_req(2)).prefill_worker_id == HOME


def test_events_supersede_in_flight_entries():
    r = router()
    first = group_req(0)
    assert r.route(first).prefill_worker_id == HOME
    # p0 reports the prefix: indexed blocks count fully, the rest stays in flight
    r.on_events(HOME, [KVEvent(1, KVEventKind.STORED, first.block_hashes[:20])])
    d = r.route(group_req(1))
    assert (d.prefill_worker_id, d.prefill_inputs.match) == (HOME, MatchInfo(20, 0, 0, 4))
    # p0 evicts everything: nothing is expected there any more
    r.on_events(HOME, [KVEvent(2, KVEventKind.CLEARED)])
    r.update_load(HOME, WorkerLoad(queued_prefill_tokens=100))
    assert r.route(group_req(2)).prefill_worker_id == AWAY


def test_removed_blocks_are_no_longer_expected():
    r = router()
    first = group_req(0)
    r.route(first)
    r.on_events(HOME, [KVEvent(1, KVEventKind.REMOVED, first.block_hashes[4:])])
    assert r.in_flight.match(group_req(1).block_hashes, 100.0) == InFlightMatch(HOME, 4)


def test_round_robin_ignores_in_flight_prefixes():
    r = Router(RouterConfig(policy="round_robin", track_in_flight=True), rng=random.Random(0), clock=Clock())
    for wid, pool in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        r.add_worker(wid, pool)
    assert [r.route(group_req(i)).prefill_worker_id for i in range(4)] == ["p0", "p1", "p0", "p1"]


def test_in_flight_tracking_is_on_by_default_and_can_be_turned_off():
    assert isinstance(Router(RouterConfig(), rng=random.Random(0), clock=Clock()).in_flight, InFlightPrefixes)
    r = Router(RouterConfig(track_in_flight=False), rng=random.Random(0), clock=Clock())
    assert isinstance(r.in_flight, NoInFlightPrefixes)
    r.in_flight.record("p0", [1, 2, 3], 0.0)
    assert r.in_flight.match([1, 2, 3], 0.0) is None and len(r.in_flight) == 0


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("shared_head", [False, True])
def test_new_conversations_spread_evenly_over_an_idle_pool(native, shared_head):
    """40 new conversations of different lengths on an idle pool of four: every choice is a
    tie, and ties go to the node with the fewest prompt tokens assigned, so the work ends up
    even (ties to the lowest index sent them all to the first node). ``shared_head``: as the
    Mooncake trace's first turns, every prompt opens with one system block every node holds
    (keyed on that first block, all 40 went to one node). A node that then reports a
    conversation's blocks gets its next turn, however much it was assigned."""
    r = Router(RouterConfig(track_in_flight=False, policy_config=PolicyConfig(
        local_prefill_threshold=0, local_prefill_hit_ratio=1.0)), rng=random.Random(0), clock=Clock(),
        native_decisions=native)
    nodes = ("p0", "p1", "p2", "p3")
    for wid, pool in [(w, "prefill") for w in nodes] + [("d0", "decode")]:
        r.add_worker(wid, pool)
    system = list(range(16)) if shared_head else []
    head = tuple(block_hashes(list(range(16)), BS))
    if shared_head:
        for w in nodes:
            r.on_events(w, [KVEvent(1, KVEventKind.STORED, head)])

    def conv(i, turn=0):
        return group_req(turn, system=system + list(range(10_000 * (i + 1), 10_000 * (i + 1) + 16 * (1 + i % 7))))

    sent = {w: 0 for w in nodes}
    homes = []
    for i in range(40):
        d = r.route(conv(i))
        homes.append(d.prefill_worker_id)
        sent[d.prefill_worker_id] += conv(i).prompt_tokens - d.prefill_cached_tokens
        for w in nodes:
            r.update_load(w, WorkerLoad())                    # idle again: every choice is a tie
    assigned = {v.worker_id: v.assigned_tokens for v in r.view.prefill}
    assert assigned == sent
    longest = max(conv(i).prompt_tokens for i in range(40))
    assert max(assigned.values()) - min(assigned.values()) <= longest, assigned
    assert all(8 <= homes.count(w) <= 12 for w in nodes), homes
    # the most-assigned node reports conversation 3's blocks: its next turn goes there
    top = max(nodes, key=assigned.__getitem__)
    blocks = conv(3).block_hashes
    r.on_events(top, [KVEvent(2 if shared_head else 1, KVEventKind.STORED, blocks[1:] if shared_head else blocks,
                              parent_hash=head[0] if shared_head else None)])
    d = r.route(conv(3, turn=1))                            # the same opening, another 2-block question
    assert (d.prefill_worker_id, d.prefill_inputs.match.blocks) == (top, len(blocks) - 2)


def test_select_breaks_ties_from_the_start_index_wrapping_round():
    rng = random.Random(0)
    assert C.select([3.0, 1.0, 2.0, 1.0], 0.0, rng) == 1
    assert C.select([3.0, 1.0, 2.0, 1.0], 0.0, rng, start=2) == 3
    assert C.select([3.0, 1.0, 2.0, 1.0], 0.0, rng, start=3) == 3
    assert C.select([1.0, 5.0, 2.0, 4.0], 0.0, rng, start=2) == 0     # no minimum after it: wraps

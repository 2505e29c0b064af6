"""A routed request's prefix stays in flight on its node while its prefill is pending (sends.py):
past the in-flight ttl, until the prefill ends, is aborted, or the node dies."""
import random
from dataclasses import replace

import pytest

from cluster.router import InFlightMatch, PolicyConfig, Router, RouterConfig, RoutingRequest, WorkerLoad
from engine.block_hash import block_hashes

BS = 16
SYSTEM = list(range(384))                       # 24 shared blocks


def group_req(i, system=SYSTEM, question_len=32):
    tokens = system + [100_000 + 977 * i + t for t in range(question_len)]
    return RoutingRequest(f"q{i}", len(tokens), tuple(block_hashes(tokens, BS)), BS)


OTHER = replace(group_req(0, system=list(range(50_000, 50_384))), request_id="other")   # shares nothing


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def router(clock, ttl=2.0, max_s=600.0, native=True):
    r = Router(RouterConfig(policy_config=PolicyConfig(local_prefill_threshold=0, local_prefill_hit_ratio=1.0),
                            in_flight_ttl_s=ttl, in_flight_max_s=max_s),
               rng=random.Random(0), clock=clock, native_decisions=native)
    for wid, pool in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        r.add_worker(wid, pool)
    return r


# an idle pool ties: the group's first block hash picks where the tie starts (policy._tie_start)
HOME, AWAY = ("p0", "p1") if group_req(0).block_hashes[0] % 2 == 0 else ("p1", "p0")


def queued_at_home(r, clock, wait_s):
    """group 0's first prompt routed HOME, where it waits ``wait_s`` behind its own 416 tokens."""
    assert r.route(group_req(0)).prefill_worker_id == HOME
    clock.t += wait_s
    r.update_load(HOME, WorkerLoad(queued_prefill_tokens=416))


@pytest.mark.parametrize("native", [True, False])
def test_a_record_outlives_the_ttl_while_its_prefill_waits(native):
    clock = Clock()
    r = router(clock, native=native)
    queued_at_home(r, clock, 25.0)                  # 12 ttls: the old record had lapsed (AWAY then)
    d = r.route(group_req(1))
    assert d.prefill_worker_id == HOME and d.prefill_inputs.match.in_flight_blocks == 24
    assert r.open_sends == 2


@pytest.mark.parametrize("native", [True, False])
def test_a_computed_prefill_is_no_longer_kept_and_lapses(native):
    clock = Clock()
    r = router(clock, native=native)
    queued_at_home(r, clock, 1.0)
    assert r.on_prefill_end("q0") and not r.on_prefill_end("q0")      # the second: nothing open
    assert r.open_sends == 0
    clock.t += 2.5                                   # a ttl past the last refresh, nothing reported
    assert r.route(group_req(1)).prefill_worker_id == AWAY


@pytest.mark.parametrize("native", [True, False])
def test_an_aborted_prefill_drops_its_record_at_once(native):
    clock = Clock()
    r = router(clock, native=native)
    queued_at_home(r, clock, 0.5)
    assert r.on_prefill_end("q0", computed=False)
    assert r.in_flight.match(group_req(1).block_hashes, clock.t) is None
    assert r.route(group_req(1)).prefill_worker_id == AWAY


def test_an_abort_leaves_another_pending_send_of_the_prefix_whole():
    """q0 and q1 share 24 blocks on HOME; q0 aborted drops them there, the next decision writes
    q1's chain back (its prefill is still pending)."""
    clock = Clock()
    r = router(clock)
    assert [r.route(group_req(i)).prefill_worker_id for i in (0, 1)] == [HOME, HOME]
    r.on_prefill_end("q0", computed=False)
    assert r.in_flight.match(group_req(1).block_hashes, clock.t) is None
    r.route(OTHER)
    assert r.in_flight.match(group_req(1).block_hashes, clock.t) == InFlightMatch(HOME, 26)


def test_a_pending_chain_stays_whole_when_a_send_sharing_its_first_blocks_ends():
    """q0 pending on HOME; q5 (the same 24 system blocks) sent AWAY takes those blocks' entries, then
    ends. Without the refresh the shared entries lapsed a ttl later and q0's chain, searched from
    its first block, matched nothing; refreshed, they stay (AWAY's: the last node sent them)."""
    clock = Clock()
    r = router(clock)
    queued_at_home(r, clock, 0.0)
    r.update_load(HOME, WorkerLoad(queued_prefill_tokens=20_000))
    assert r.route(group_req(5)).prefill_worker_id == AWAY
    r.on_prefill_end("q5")
    for _ in range(4):
        clock.t += 1.5
        r.route(OTHER)
        r.on_prefill_end(OTHER.request_id)
    assert r.in_flight.match(group_req(0).block_hashes, clock.t) == InFlightMatch(HOME, 26)
    assert r.in_flight.match(group_req(5).block_hashes, clock.t) == InFlightMatch(AWAY, 24)


def test_a_dead_worker_s_pending_sends_are_not_written_back():
    clock = Clock()
    r = router(clock)
    queued_at_home(r, clock, 0.5)
    r.on_worker_dead(HOME)
    r.update_load(HOME, WorkerLoad(queued_prefill_tokens=416))       # back, holding nothing
    assert r.open_sends == 0
    clock.t += 5.0
    r.route(OTHER)
    assert r.in_flight.match(group_req(1).block_hashes, clock.t) is None


def test_a_send_whose_end_never_comes_is_kept_in_flight_max_s_at_most():
    clock = Clock()
    r = router(clock, max_s=30.0)
    queued_at_home(r, clock, 0.0)
    for _ in range(20):                              # decisions every 1.5 s: refreshed up to 30 s
        clock.t += 1.5
        r.route(OTHER)
        r.on_prefill_end(OTHER.request_id)
        expected = InFlightMatch(HOME, 26) if clock.t - 100.0 <= 30.0 else None
        assert r.in_flight.match(group_req(0).block_hashes, clock.t) == expected, clock.t
    assert r.open_sends == 0


def test_in_flight_max_s_must_be_positive():
    with pytest.raises(ValueError, match="in_flight_max_s"):
        RouterConfig(in_flight_max_s=0)


def spy_refreshes(r, monkeypatch):
    """The chains route() refreshes, as the real InFlightPrefixes.refresh is called (then run)."""
    seen: list[tuple[int, ...]] = []
    real = r.in_flight.refresh

    def refresh(worker_id, block_hashes, now):
        seen.append(tuple(block_hashes))
        real(worker_id, block_hashes, now)

    monkeypatch.setattr(r.in_flight, "refresh", refresh)
    return seen


def lone_req(i):
    return group_req(0, system=list(range(200_000 + 1000 * i, 200_000 + 1000 * i + 384)))


def test_each_open_send_is_refreshed_half_a_ttl_after_it_was_sent_not_all_at_once(monkeypatch):
    """Ten pending sends 0.1 s apart (ttl 2 s): each decision refreshes the one due since the last,
    half a ttl after it was sent (refreshing every open send in the decision that found the first
    one due paused that decision 10-30 us per open send); every chain stays in flight for 5 ttls."""
    clock = Clock()
    r = router(clock)
    pending = [replace(lone_req(i), request_id=f"p{i}") for i in range(10)]
    where = {}
    for req in pending:
        where[req.request_id] = r.route(req).prefill_worker_id
        clock.t += 0.1
    seen = spy_refreshes(r, monkeypatch)
    per_decision = []
    for k in range(100):                               # decisions 0.1 s apart, 5 ttls
        clock.t = 101.05 + 0.1 * k
        before = len(seen)
        r.route(replace(lone_req(100 + k), request_id=f"o{k}"))
        r.on_prefill_end(f"o{k}")
        per_decision.append(seen[before:])
        for req in pending:
            assert r.in_flight.match(req.block_hashes, clock.t) == InFlightMatch(where[req.request_id], 26), k
    # decision k (at 101.05 + 0.1 k) refreshes p(k mod 10), sent or last refreshed at 100 + 0.1 k
    assert per_decision == [[pending[k % 10].block_hashes] for k in range(100)]
    assert r.open_sends == 10


def test_an_abort_refreshes_the_sends_sharing_its_first_block_only(monkeypatch):
    """q0 aborted: the next decision writes back q1 (the same system prompt, pending on the same
    node) and leaves the unrelated pending send alone until it is due."""
    clock = Clock()
    r = router(clock)
    lone = replace(lone_req(7), request_id="lone")
    r.route(lone)
    node = r.route(group_req(0)).prefill_worker_id
    assert r.route(group_req(1)).prefill_worker_id == node        # (in flight there)
    seen = spy_refreshes(r, monkeypatch)
    r.on_prefill_end("q0", computed=False)
    clock.t += 0.1
    r.route(OTHER)
    assert seen == [group_req(1).block_hashes]
    assert r.in_flight.match(group_req(1).block_hashes, clock.t) == InFlightMatch(node, 26)

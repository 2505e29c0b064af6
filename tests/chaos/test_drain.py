"""Scale-down under load: `drain_worker` on a random worker at a random moment.
Its queued requests move to other workers, its running ones finish, every
request ends with exactly its undisturbed tokens, and afterwards nothing is
routed to it until it is undrained. Also: leases are renewed while decode
nodes queue for KV room (the chaos cluster's lease_ttl is 2 s) and none
expires; the KV side channel listens on the node's own address only."""
from __future__ import annotations

import asyncio
import random

import pytest

from chaos_lib import check_leases, check_outcomes, trials
from chaos_load import TokenCount, draw_requests, run_load
from kv_peer import listening_sockets

pytestmark = pytest.mark.ray


async def reported_waiting(c, worker_id: str) -> int:
    """The worker's queue (in its engine, or hand-offs waiting for KV room) as its last report gave it to the router."""
    view = await c.on_loop(lambda: c.backend.router.view)
    return next(w.load.waiting for w in view.prefill + view.decode if w.worker_id == worker_id)


def run_drain(c, hf, report, n_trials: int, n_requests: int, seed: int) -> int:
    """Trial 0 drains a decode worker the moment its report shows a queue, so
    there is something to give back (`moved`); the other trials drain a random
    worker at a random moment. Returns the requests moved by trial 0."""
    rng = random.Random(seed)
    moved_first = 0
    for t in range(n_trials):
        c.settle()
        on_queue = t == 0
        victim = rng.choice(c.pool("decode") if on_queue else c.pool("decode") + c.pool("prefill"))
        reqs, refs = draw_requests(rng, hf, n_requests, f"dr{seed}-{t}", max_tokens=32)
        before = c.counters()
        threshold = 0.0 if on_queue else rng.uniform(0.0, 0.3) * sum(r.max_tokens for r in reqs)
        streamed, drained = TokenCount(), {}

        async def fault():
            while streamed.total < threshold:
                await asyncio.sleep(0.01)
            while on_queue and await reported_waiting(c, victim) == 0:
                await asyncio.sleep(0.01)
            drained["report"] = await asyncio.wrap_future(c.loop.submit(c.backend.drain_worker(victim, 300)))

        try:
            outs = asyncio.run(run_load(c.target, reqs, on_chunk=streamed, during=fault))
            errors = check_outcomes(outs, refs, allowed=set(), explain=c.explain)
            assert drained, "the fault never fired"
            rep = drained["report"]
            assert rep.idle and rep.in_flight == 0, rep
            # drained: new requests never touch it
            queried = c.call(victim, "report").stats.prefix_queried_tokens
            more, more_refs = draw_requests(rng, hf, 6, f"dr{seed}-{t}-after", max_tokens=4)
            check_outcomes(asyncio.run(run_load(c.target, more)), more_refs, allowed=set(), explain=c.explain)
            assert c.call(victim, "report").stats.prefix_queried_tokens == queried, f"{victim} got work while drained"
        finally:   # a failed trial must not leave the worker unrouted for the tests after it
            c.loop.run(c.backend.undrain_worker(victim))
        leaked = c.settle()
        moved = c.counters()["moved"] - before["moved"]
        events = [rid for rid, k in c.events() if k == "moved" and rid.startswith(f"dr{seed}-{t}-")]
        assert len(events) == moved
        if on_queue:
            moved_first = moved
        report.add("drain one worker (scale-down)", outs, errors=errors, leaked=leaked, moved=moved,
                   **{f"drained_{victim.split('-')[0]}": 1})
    return moved_first


def test_drain_worker_fast(chaos_cluster, hf_model, chaos_report):
    moved = run_drain(chaos_cluster, hf_model, chaos_report, trials(2, 20, False), 48, seed=7)
    # max_num_seqs=8 per worker and 48 requests at once: the decode worker drained while its
    # report showed a queue gives queued requests back (they are moved, not dropped)
    assert moved >= 1, "no queued request was moved off a draining worker"


@pytest.mark.chaos_full
@pytest.mark.timeout(7200)
def test_drain_worker_full(chaos_cluster, hf_model, chaos_report):
    moved = run_drain(chaos_cluster, hf_model, chaos_report, trials(2, 20, True), 48, seed=707)
    assert moved >= 1, "no queued request was moved off a draining worker"


def test_leases_renewed_while_decode_queues_none_expire(chaos_cluster, hf_model, chaos_report):
    c = chaos_cluster
    c.settle()
    reqs, refs = draw_requests(random.Random(8), hf_model, 40, "renew", max_tokens=48)
    before, leases0 = c.counters(), c.lease_counters()
    outs = asyncio.run(run_load(c.target, reqs))
    errors = check_outcomes(outs, refs, allowed=set(), explain=c.explain)
    leaked = c.settle()
    leases = check_leases(leases0, c.lease_counters())
    renewed = c.counters()["lease_renewals"] - before["lease_renewals"]
    # 16 decode slots for 40 requests: on a slow host decode nodes queue longer than the 2 s
    # lease and renew it; however long they queued, no lease may expire and the counts agree.
    # (Renewal itself is pinned deterministically in test_leases_admission.py.)
    assert leases["renewed"] == renewed, (renewed, leases)
    assert leases["expired"] == 0, leases
    assert leases["pinned"] == leases["notified"] + leases["released"], leases
    chaos_report.add("lease renewal under queueing", outs, errors=errors, leaked=leaked,
                     leases_renewed=renewed, leases_expired=leases["expired"])


def test_kv_side_channel_listens_on_the_node_address_only(chaos_cluster):
    """The KV side channel of every prefill worker listens on the node's address
    (127.0.0.1 here) and on nothing else. (Ray's own gRPC servers inside the same
    processes listen on the IPv6 wildcard: that is Ray's, see docs/deploy.md.)"""
    c = chaos_cluster
    c.wait_alive()
    for w in c.backend.workers:
        socks = listening_sockets(c.pid(w))
        if w.startswith("prefill"):
            peer = c.call(w, "peer_info")
            assert peer.host == "127.0.0.1" and (peer.host, peer.port) in socks
            assert [ip for ip, port in socks if port == peer.port] == ["127.0.0.1"], (w, socks)

"""The prefill gate (cluster/orchestration/prefill_gate.py) in front of a real Router, and the
count it keeps (cluster/router/outstanding.py): held while every prefill node has more than
the limit outstanding, routed oldest first the moment a prefill ends, a burst spread over the
nodes that free, cancelled requests never routed, errors to the request that would have been
routed, and the gate off, a short prompt or no prefill node routing at once."""
from __future__ import annotations

import asyncio
import random

import pytest

from cluster.config import ServeConfig
from cluster.orchestration.backend import BackendError
from cluster.orchestration.prefill_gate import PrefillGate
from cluster.router import NoWorkerAvailable, Router, RouterConfig, RoutingRequest, WorkerLoad
from cluster.router.outstanding import OutstandingPrefills

BS = 16


def _router(native: bool = True) -> Router:
    r = Router(RouterConfig(), rng=random.Random(0), clock=lambda: 100.0, native_decisions=native)
    for w, pool in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        r.add_worker(w, pool)
        r.update_load(w, WorkerLoad())
    return r


def _live(router: Router):
    return lambda: [v.worker_id for v in router.view.prefill]


def _gate(router: Router, limit: int, waits: list[float] | None = None) -> PrefillGate:
    return PrefillGate(limit, _live(router), on_wait=(waits if waits is not None else []).append)


def _route(router: Router, rid: str, n: int = 256):
    base = sum(map(ord, rid)) * 1000            # each request its own prompt: no shared prefix
    return lambda: router.route(RoutingRequest(rid, n, tuple(range(base, base + n // BS)), BS))


def test_outstanding_counts_what_was_sent_until_it_ends():
    o = OutstandingPrefills()
    assert o.room([], 0) and o.room(["p0"], 0)
    o.sent("a", "p0", 300)
    o.sent("b", "p0", 200)
    o.sent("c", "p1", 50)
    assert (o.tokens("p0"), o.tokens("p1"), len(o)) == (500, 50, 3)
    assert not o.room(["p0", "p1"], 0) and o.room(["p0", "p1"], 50) and not o.room(["p0"], 499)
    o.sent("c", "p0", 10)                       # sent again (elsewhere): replaces the first send
    assert (o.tokens("p0"), o.tokens("p1")) == (510, 0) and o.room(["p1"], 0)
    assert o.ended("a") and not o.ended("a") and not o.ended("never")
    assert o.tokens("p0") == 210
    with pytest.raises(ValueError, match="must be >= 0"):
        o.sent("d", "p0", -1)


@pytest.mark.parametrize("native", [True, False])
def test_held_while_every_prefill_node_is_busy_then_routed_oldest_first_as_prefills_end(native):
    router = _router(native)

    async def main():
        waits: list[float] = []
        gate = _gate(router, 0, waits)
        a = await gate.route(_route(router, "a"), 256)          # both idle: routed at once
        b = await gate.route(_route(router, "b"), 256)          # the other node, still idle
        assert {a.prefill_worker_id, b.prefill_worker_id} == {"p0", "p1"} and waits == [0.0, 0.0]
        assert gate.outstanding.tokens("p0") == gate.outstanding.tokens("p1") == 256
        tasks = [asyncio.ensure_future(gate.route(_route(router, rid), 256)) for rid in ("c", "d", "e")]
        await asyncio.sleep(0)
        assert len(gate) == 3 and not any(t.done() for t in tasks)
        assert gate.release() == 0                               # nothing ended: still no room
        gate.ended("a")                                          # a's prefill returned: its node is free
        c = await tasks[0]
        assert c.request_id == "c" and c.prefill_worker_id == a.prefill_worker_id and len(gate) == 2
        gate.ended("b")
        d = await tasks[1]
        assert d.prefill_worker_id == b.prefill_worker_id and not tasks[2].done()
        gate.ended("c")
        assert (await tasks[2]).request_id == "e" and len(gate) == 0
        assert len(waits) == 5 and all(w >= 0 for w in waits)

    asyncio.run(main())


def test_a_cancelled_held_request_is_never_routed():
    router = _router()
    routed: list[str] = []

    def route(rid):
        inner = _route(router, rid)
        return lambda: (routed.append(rid), inner())[1]

    async def main():
        gate = _gate(router, 0)
        await gate.route(route("x"), 256)
        await gate.route(route("y"), 256)                        # both nodes busy now
        gone = asyncio.ensure_future(gate.route(route("gone"), 256))
        kept = asyncio.ensure_future(gate.route(route("kept"), 256))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert len(gate) == 1
        gate.ended("x")
        assert (await kept).request_id == "kept" and routed == ["x", "y", "kept"]

    asyncio.run(main())


def test_the_routing_error_goes_to_the_held_request_and_the_queue_moves_on():
    router = _router()

    async def main():
        gate = _gate(router, 0)
        await gate.route(_route(router, "x"), 256)
        await gate.route(_route(router, "y"), 256)

        def fail():
            raise BackendError("UNAVAILABLE", "no worker available")

        failing = asyncio.ensure_future(gate.route(fail, 256))
        ok = asyncio.ensure_future(gate.route(_route(router, "ok"), 256))
        await asyncio.sleep(0)
        gate.ended("x")
        with pytest.raises(BackendError, match="no worker available"):
            await failing
        assert (await ok).request_id == "ok"

    asyncio.run(main())


def test_off_or_short_or_without_prefill_nodes_or_at_stop_it_routes_at_once():
    router = _router()

    async def main():
        off = _gate(router, -1)
        assert not off.enabled and (await off.route(_route(router, "x"), 256)).request_id == "x"
        assert len(off.outstanding) == 0                          # off: nothing counted
        gate = _gate(router, 0)
        await gate.route(_route(router, "a"), 256)
        await gate.route(_route(router, "b"), 256)
        short = await gate.route(_route(router, "short"), 256, may_hold=False)   # the decode node's to prefill
        assert short.request_id == "short" and len(gate) == 0
        held = asyncio.ensure_future(gate.route(_route(router, "held"), 256))
        await asyncio.sleep(0)
        assert len(gate) == 1
        gate.release_all()                                        # the pool stops: nobody left waiting
        assert (await held).request_id == "held" and len(gate) == 0
        for w in ("p0", "p1"):                                    # every prefill node gone
            router.on_worker_dead(w)
            router.update_load(w, WorkerLoad(alive=False))
        assert gate.room()
        lone = await gate.route(_route(router, "lone"), 256)
        assert lone.prefill_worker_id is None and lone.decode_worker_id == "d0"

    asyncio.run(main())


def test_bad_limits_say_what_to_give():
    with pytest.raises(ValueError, match="prefill_queue_limit must be -1"):
        PrefillGate(-2, lambda: [])
    with pytest.raises(ValueError, match="prefill_queue_limit must be -1"):
        ServeConfig(prefill_queue_limit=-5)
    assert ServeConfig(prefill_queue_limit=0).prefill_queue_limit == 0


def test_no_decode_worker_is_the_routers_error_not_a_hang():
    router = Router(RouterConfig(), rng=random.Random(0), clock=lambda: 1.0)
    router.add_worker("p0", "prefill")
    router.update_load("p0", WorkerLoad())

    async def main():
        with pytest.raises(NoWorkerAvailable):
            await _gate(router, 0).route(_route(router, "r"), 256)

    asyncio.run(main())

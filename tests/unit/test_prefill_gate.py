"""The prefill gate (cluster/orchestration/prefill_gate.py) in front of a real Router: held
while every prefill node is busier than the limit, routed oldest first when a report shows
room, a burst spread over the nodes that free, cancelled requests never routed, errors to the
request that would have been routed, and the gate off or without prefill nodes routing at once."""
from __future__ import annotations

import asyncio
import random

import pytest

from cluster.config import ServeConfig
from cluster.orchestration.backend import BackendError
from cluster.orchestration.prefill_gate import PrefillGate
from cluster.router import NoWorkerAvailable, Router, RouterConfig, RoutingRequest, WorkerLoad

BS = 16


def _router(native: bool = True) -> Router:
    r = Router(RouterConfig(), rng=random.Random(0), clock=lambda: 100.0, native_decisions=native)
    for w, pool in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        r.add_worker(w, pool)
        r.update_load(w, WorkerLoad())
    return r


def _gate(router: Router, limit: int, waits: list[float] | None = None) -> PrefillGate:
    return PrefillGate(limit, router.prefill_room, on_wait=(waits if waits is not None else []).append)


def _route(router: Router, rid: str, n: int = 256):
    return lambda: router.route(RoutingRequest(rid, n, tuple(range(hash(rid) % 1000 * 100, hash(rid) % 1000 * 100
                                                                  + n // BS)), BS))


@pytest.mark.parametrize("native", [True, False])
def test_held_while_every_prefill_node_is_busy_then_routed_oldest_first_where_room_shows(native):
    router = _router(native)

    async def main():
        waits: list[float] = []
        gate = _gate(router, 0, waits)
        first = await gate.route(_route(router, "a"))              # both idle: routed at once, not held
        assert first.prefill_worker_id in ("p0", "p1") and waits == [0.0]
        router.update_load("p0", WorkerLoad(queued_prefill_tokens=4000))
        router.update_load("p1", WorkerLoad(queued_prefill_tokens=300))
        assert not router.prefill_room(0) and router.prefill_room(300)
        tasks = [asyncio.ensure_future(gate.route(_route(router, rid))) for rid in ("b", "c", "d")]
        await asyncio.sleep(0)
        assert len(gate) == 3 and not any(t.done() for t in tasks)
        assert gate.release() == 0                                  # no report changed: still no room
        router.update_load("p1", WorkerLoad())                      # p1 drained its queue
        assert gate.release() == 1                                  # b goes there; its tokens fill p1 again
        b = await tasks[0]
        assert b.request_id == "b" and b.prefill_worker_id == "p1" and len(gate) == 2
        router.update_load("p0", WorkerLoad())
        router.update_load("p1", WorkerLoad())
        assert gate.release() == 2
        c, d = await tasks[1], await tasks[2]
        assert {c.prefill_worker_id, d.prefill_worker_id} == {"p0", "p1"}    # spread, not both on one node
        assert len(waits) == 4 and all(w >= 0 for w in waits)

    asyncio.run(main())


def test_a_cancelled_held_request_is_never_routed():
    router = _router()
    routed: list[str] = []

    def route(rid):
        inner = _route(router, rid)
        return lambda: (routed.append(rid), inner())[1]

    async def main():
        gate = _gate(router, 0)
        for w in ("p0", "p1"):
            router.update_load(w, WorkerLoad(queued_prefill_tokens=1000))
        gone = asyncio.ensure_future(gate.route(route("gone")))
        kept = asyncio.ensure_future(gate.route(route("kept")))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert len(gate) == 1
        router.update_load("p0", WorkerLoad())
        gate.release()
        assert (await kept).request_id == "kept" and routed == ["kept"]

    asyncio.run(main())


def test_the_routing_error_goes_to_the_held_request_and_the_queue_moves_on():
    router = _router()

    async def main():
        gate = _gate(router, 0)
        for w in ("p0", "p1"):
            router.update_load(w, WorkerLoad(queued_prefill_tokens=1000))
        failing = asyncio.ensure_future(gate.route(lambda: (_ for _ in ()).throw(
            BackendError("UNAVAILABLE", "no worker available"))))
        ok = asyncio.ensure_future(gate.route(_route(router, "ok")))
        await asyncio.sleep(0)
        router.update_load("p0", WorkerLoad())
        router.update_load("p1", WorkerLoad())
        gate.release()
        with pytest.raises(BackendError, match="no worker available"):
            await failing
        assert (await ok).request_id == "ok"

    asyncio.run(main())


def test_off_or_without_prefill_nodes_or_at_stop_it_routes_at_once():
    router = _router()
    for w in ("p0", "p1"):
        router.update_load(w, WorkerLoad(queued_prefill_tokens=10_000))

    async def main():
        off = _gate(router, -1)
        assert not off.enabled and (await off.route(_route(router, "x"))).request_id == "x"
        gate = _gate(router, 0)
        held = asyncio.ensure_future(gate.route(_route(router, "held")))
        await asyncio.sleep(0)
        assert len(gate) == 1
        gate.release_all()                                          # the pool stops: nobody left waiting
        assert (await held).request_id == "held" and len(gate) == 0
        for w in ("p0", "p1"):                                      # every prefill node gone
            router.on_worker_dead(w)
            router.update_load(w, WorkerLoad(alive=False))
        assert router.prefill_room(0)
        lone = await gate.route(_route(router, "lone"))
        assert lone.prefill_worker_id is None and lone.decode_worker_id == "d0"

    asyncio.run(main())


def test_bad_limits_say_what_to_give():
    with pytest.raises(ValueError, match="prefill_queue_limit must be -1"):
        PrefillGate(-2, lambda limit: True)
    with pytest.raises(ValueError, match="prefill_queue_limit must be -1"):
        ServeConfig(prefill_queue_limit=-5)
    assert ServeConfig(prefill_queue_limit=0).prefill_queue_limit == 0


def test_no_decode_worker_is_the_routers_error_not_a_hang():
    router = Router(RouterConfig(), rng=random.Random(0), clock=lambda: 1.0)
    router.add_worker("p0", "prefill")
    router.update_load("p0", WorkerLoad())

    async def main():
        with pytest.raises(NoWorkerAvailable):
            await _gate(router, 0).route(_route(router, "r"))

    asyncio.run(main())

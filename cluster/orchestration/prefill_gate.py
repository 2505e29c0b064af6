"""`PrefillGate`: route a request when a prefill node can start it, not on arrival.

With ``ServeConfig.prefill_queue_limit`` >= 0, an arriving request is routed at
once while some live prefill node has at most that many prompt tokens queued
(its last report plus what was routed there since: ``Router.prefill_room``).
While every prefill node is busier, requests wait here, in one FIFO, and each
report round (``WorkerPool``'s poll, every ``report_interval``) routes the
oldest of them while a node has room again. The router then decides with the
loads and caches of that moment: a request that arrived in a burst goes to the
node that freed first, or to the holder of its prefix if that is still worth
it, instead of being bound, at arrival, to a node whose queue turned out
longer than it looked (a long cold prompt ahead of it). Routed requests queue
on the workers as before; this only holds the surplus at the head. The idea is
the central queue of late binding (one queue in front of many servers never
lets a request wait on one node while another idles); benchmarks/routing_sim.py
``--prefill-queue-limit`` and benchmarks/routing.py measure it (docs/benchmarks.md).

-1 (the default) turns the gate off: every request is routed on arrival. With
no live prefill node the gate never holds (the router decides: the decode pool
prefills, or no worker is available). A held request that is cancelled (client
gone, deadline) leaves the queue without being routed.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from cluster.router.policy import RoutingDecision


@dataclass
class _Held:
    route: Callable[[], RoutingDecision]
    future: asyncio.Future
    since: float


class PrefillGate:
    def __init__(self, limit: int, room: Callable[[int], bool], *,
                 on_wait: Callable[[float], None] = lambda seconds: None,
                 on_depth: Callable[[int], None] = lambda depth: None,
                 on_abandoned: Callable[[RoutingDecision], None] = lambda decision: None) -> None:
        """``room(limit)``: whether a prefill node has at most ``limit`` tokens queued
        (``Router.prefill_room``); ``on_wait``: seconds each routed request was held (0 when
        not); ``on_depth``: the number held, whenever it changes; ``on_abandoned``: a decision
        made for a request whose caller was cancelled in the same moment (its send is ended)."""
        if limit < -1:
            raise ValueError(f"prefill_queue_limit must be -1 (off) or >= 0 prompt tokens, got {limit}")
        self.limit = limit
        self._room = room
        self._on_wait, self._on_depth, self._on_abandoned = on_wait, on_depth, on_abandoned
        self._held: deque[_Held] = deque()

    @property
    def enabled(self) -> bool:
        return self.limit >= 0

    def __len__(self) -> int:
        return len(self._held)

    async def route(self, route: Callable[[], RoutingDecision]) -> RoutingDecision:
        """``route()``'s decision, called now if the gate is off or a prefill node has room and
        nobody is held before this request, else when a report shows room (``release``). Its
        exception (no worker available) is raised here."""
        if not self.enabled or (not self._held and self._room(self.limit)):
            self._on_wait(0.0)
            return route()
        held = _Held(route, asyncio.get_running_loop().create_future(), time.monotonic())
        self._held.append(held)
        self._on_depth(len(self._held))
        try:
            return await held.future
        except asyncio.CancelledError:
            f = held.future
            if f.done() and not f.cancelled() and f.exception() is None:
                self._on_abandoned(f.result())   # routed just as the caller left: undo the send
            else:
                self._drop(held)             # cancelled while held: leaves the queue unrouted
            raise

    def release(self) -> int:
        """Route held requests, oldest first, while a prefill node has room (each routing adds
        its tokens to that node's queue, so a burst is spread, not poured on one node).
        Returns how many were routed."""
        routed = 0
        while self._held and self._room(self.limit):
            held = self._held.popleft()
            if held.future.done():           # cancelled meanwhile
                continue
            self._on_wait(time.monotonic() - held.since)
            self._settle(held)
            routed += 1
        self._on_depth(len(self._held))
        return routed

    def release_all(self) -> None:
        """Route every held request now, room or not (the pool stops, or no report can come)."""
        while self._held:
            held = self._held.popleft()
            if not held.future.done():
                self._on_wait(time.monotonic() - held.since)
                self._settle(held)
        self._on_depth(0)

    @staticmethod
    def _settle(held: _Held) -> None:
        try:
            held.future.set_result(held.route())
        except Exception as e:               # NoWorkerAvailable's BackendError: that request's error
            held.future.set_exception(e)

    def _drop(self, held: _Held) -> None:
        try:
            self._held.remove(held)
        except ValueError:
            return
        self._on_depth(len(self._held))

"""`PrefillGate`: route a request when a prefill node can start it, not on arrival.

With ``ServeConfig.prefill_queue_limit`` >= 0, an arriving request is routed at
once while some live prefill node has at most that many prompt tokens
outstanding: sent there by this frontend and not finished
(cluster/router/outstanding.py, counted exactly, no report in between). While
every prefill node is busier, requests wait here, in one FIFO, and the end of a
prefill (its first token back, or its failure) routes the oldest while a node
has room again. The router then decides with the caches and loads of that
moment: a request that arrived in a burst goes to the node that freed first,
or to the holder of its prefix if that is still worth it, instead of being
bound, at arrival, to a node whose queue turned out longer than it looked (a
long cold prompt ahead of it). This is the central queue of late binding (one
queue in front of many servers never lets a request wait on one node while
another idles); benchmarks/routing_sim.py ``--prefill-queue-limit`` and
benchmarks/routing.py measure it (docs/benchmarks.md, "The prefill gate").

-1 (the default) turns the gate off: every request is routed on arrival. With
no live prefill node the gate never holds (the router decides: the decode pool
prefills, or no worker is available), nor a prompt short enough for the decode
node to prefill it itself (``local_prefill_threshold``). A held request that is
cancelled (client gone, deadline) leaves the queue without being routed.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from cluster.router.outstanding import OutstandingPrefills
from cluster.router.policy import DecisionKind, RoutingDecision


@dataclass
class _Held:
    route: Callable[[], RoutingDecision]
    prompt_tokens: int
    future: asyncio.Future
    since: float


class PrefillGate:
    def __init__(self, limit: int, live_prefill: Callable[[], Iterable[str]], *,
                 on_wait: Callable[[float], None] = lambda seconds: None,
                 on_depth: Callable[[int], None] = lambda depth: None,
                 on_abandoned: Callable[[RoutingDecision], None] = lambda decision: None) -> None:
        """``live_prefill()``: the ids of the prefill nodes routed to now; ``on_wait``: seconds
        each routed request was held (0 when not); ``on_depth``: the number held, whenever it
        changes; ``on_abandoned``: a decision made for a request whose caller was cancelled in
        the same moment (its send is ended)."""
        if limit < -1:
            raise ValueError(f"prefill_queue_limit must be -1 (off) or >= 0 prompt tokens, got {limit}")
        self.limit = limit
        self.outstanding = OutstandingPrefills()
        self._live_prefill = live_prefill
        self._on_wait, self._on_depth, self._on_abandoned = on_wait, on_depth, on_abandoned
        self._held: deque[_Held] = deque()

    def room(self) -> bool:
        """Some live prefill node has at most ``limit`` prompt tokens outstanding."""
        return self.outstanding.room(self._live_prefill(), self.limit)

    def ended(self, request_id: str) -> None:
        """The prefill of ``request_id`` is over (computed, failed, given back, aborted): its
        node's tokens come off, and held requests go where there is room."""
        if self.outstanding.ended(request_id) and self._held:
            self.release()

    @property
    def enabled(self) -> bool:
        return self.limit >= 0

    def __len__(self) -> int:
        return len(self._held)

    async def route(self, route: Callable[[], RoutingDecision], prompt_tokens: int, *,
                    may_hold: bool = True) -> RoutingDecision:
        """``route()``'s decision, called now if the gate is off, the request may not be held
        (``may_hold`` False: one the decode node prefills itself), or a prefill node has room
        and nobody is held before this request; else when a prefill ends and leaves room
        (``ended`` -> ``release``). Its exception (no worker available) is raised here."""
        if not self.enabled or not may_hold or (not self._held and self.room()):
            self._on_wait(0.0)
            return self._counted(route(), prompt_tokens)
        held = _Held(route, prompt_tokens, asyncio.get_running_loop().create_future(), time.monotonic())
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
        """Route held requests, oldest first, while a prefill node has room (each routing counts
        its tokens outstanding on its node, so a burst is spread, not poured on one node).
        Returns how many were routed."""
        if not self._held:
            return 0
        routed = 0
        while self._held and self.room():
            held = self._held.popleft()
            if held.future.done():           # cancelled meanwhile
                continue
            self._on_wait(time.monotonic() - held.since)
            self._settle(held)
            routed += 1
        self._on_depth(len(self._held))
        return routed

    def release_all(self) -> None:
        """Route every held request now, room or not (the pool stops)."""
        while self._held:
            held = self._held.popleft()
            if not held.future.done():
                self._on_wait(time.monotonic() - held.since)
                self._settle(held)
        self._on_depth(0)

    def _settle(self, held: _Held) -> None:
        try:
            held.future.set_result(self._counted(held.route(), held.prompt_tokens))
        except Exception as e:               # NoWorkerAvailable's BackendError: that request's error
            held.future.set_exception(e)

    def _counted(self, decision: RoutingDecision, prompt_tokens: int) -> RoutingDecision:
        """A prefill node's share of the decision counted as outstanding there."""
        if self.enabled and decision.kind is DecisionKind.REMOTE_PREFILL and decision.prefill_worker_id:
            self.outstanding.sent(decision.request_id, decision.prefill_worker_id,
                                  max(0, prompt_tokens - decision.prefill_cached_tokens))
        return decision

    def _drop(self, held: _Held) -> None:
        try:
            self._held.remove(held)
        except ValueError:
            return
        self._on_depth(len(self._held))

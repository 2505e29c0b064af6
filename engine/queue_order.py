"""The order a scheduler admits its waiting requests in (SchedulerConfig.queue_order).

``fcfs`` (the default): arrival order; preempted requests go back to the front.

``fewest_uncached``: shortest job first, the job being the prompt tokens the
node would compute, known at admission from the prefix cache (a request whose
prefix is cached costs only its uncached tail); ties keep FCFS order.
Preempted requests, then requests that have waited ``max_pass_s`` or longer
since they were added go first, in FCFS order, so no request is passed over for longer than that: a long cold prompt
waits at most ``max_pass_s`` behind shorter ones, then behind only what came
before it. Once admitted a request is never put back behind a shorter one
(running requests keep arrival order), so this is non-preemptive.

SGLang's "lpm" policy (longest prefix match first) and vLLM's priority
scheduling are the references; this one sorts by uncached tokens, not by
cached ones, and bounds how long a request may be passed over.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from engine.request import Request, RequestStatus

QUEUE_ORDERS = ("fcfs", "fewest_uncached")


class QueueOrder:
    """FCFS: leaves the waiting queue as it is."""

    def added(self, request_id: str, clock: Callable[[], float]) -> None:
        """A request joined the waiting queue (``clock()``: the scheduler's time)."""

    def arrange(self, waiting: deque[Request], uncached: Callable[[Request], int],
                clock: Callable[[], float]) -> None:
        """Reorder ``waiting`` in place before admission. ``uncached(r)``: the prompt
        tokens ``r`` would compute now; ``clock()``: the scheduler's time."""


class FewestUncachedFirst(QueueOrder):
    def __init__(self, max_pass_s: float) -> None:
        if max_pass_s <= 0:
            raise ValueError(f"queue_max_pass_s must be > 0 seconds (how long a request may be passed over "
                             f"by shorter ones), got {max_pass_s}")
        self.max_pass_s = max_pass_s
        # request id -> when it was added (or an arrange first saw it waiting); those gone are dropped
        self._since: dict[str, float] = {}

    def added(self, request_id: str, clock: Callable[[], float]) -> None:
        self._since[request_id] = clock()

    def arrange(self, waiting: deque[Request], uncached: Callable[[Request], int],
                clock: Callable[[], float]) -> None:
        now, seen = clock(), self._since
        self._since = since = {r.request_id: seen.get(r.request_id, now) for r in waiting}
        first: list[Request] = []
        rest: list[tuple[int, int, Request]] = []
        for i, r in enumerate(waiting):
            if r.status is RequestStatus.PREEMPTED or now - since[r.request_id] >= self.max_pass_s:
                first.append(r)
            else:
                rest.append((uncached(r), i, r))
        first.sort(key=lambda r: (r.status is not RequestStatus.PREEMPTED, since[r.request_id]))
        rest.sort(key=lambda t: (t[0], t[1]))
        waiting.clear()
        waiting.extend(first)
        waiting.extend(r for _, _, r in rest)


def make_queue_order(name: str, max_pass_s: float) -> QueueOrder:
    if name == "fcfs":
        return QueueOrder()
    if name == "fewest_uncached":
        return FewestUncachedFirst(max_pass_s)
    raise ValueError(f"queue_order must be one of {', '.join(QUEUE_ORDERS)}, got {name!r}")

"""Single-threaded discrete-event loop on a `VirtualClock`.

Events are ``(time, seq, fn, args)`` in a heap; ties run in scheduling order
(``seq``), so a run is deterministic. Cancelling is the caller's business:
components keep a generation counter and ignore stale callbacks (cheaper
than tombstones on a heap of millions of events).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable

from cluster.tools.sim.clock import VirtualClock


class EventLoop:
    def __init__(self, clock: VirtualClock | None = None) -> None:
        self.clock = clock if clock is not None else VirtualClock()
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = itertools.count()
        self.events_run = 0

    @property
    def now(self) -> float:
        return self.clock.now()

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (not before now)."""
        if t < self.clock.now():
            raise ValueError(f"cannot schedule at {t}: it is already {self.clock.now()}; "
                             "use a time >= now")
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay}")
        self.at(self.clock.now() + delay, fn, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None, max_events: int | None = None) -> int:
        """Run events in time order until the heap is empty, the next event is
        after ``until`` (the clock then stops at ``until``) or ``max_events``
        ran. Returns the number of events run."""
        heap, clock, n = self._heap, self.clock, 0
        pop = heapq.heappop
        while heap and (max_events is None or n < max_events):
            t = heap[0][0]
            if until is not None and t > until:
                clock.advance_to(until)
                break
            _, _, fn, args = pop(heap)
            clock.advance_to(t)
            fn(*args)
            n += 1
        self.events_run += n
        return n

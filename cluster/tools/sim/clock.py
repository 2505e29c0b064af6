"""A virtual clock: the time source injected into pdserve's own components
(`Scheduler(clock=...)`, `Router(clock=...)`) so they run on simulated time."""
from __future__ import annotations


class VirtualClock:
    """Monotonic simulated seconds. Call it like ``time.monotonic``."""
    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def __call__(self) -> float:
        return self._now

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"virtual time cannot go back: now {self._now}, asked {t}; "
                             "schedule events at or after the current time")
        self._now = t

"""The TTFT wait-miss: did a request miss the TTFT target by waiting?

`PrefillSignals.ttft_wait_miss_fraction` is, of the requests whose first token came
in a window and whose prefill alone (on an idle worker, no queueing) fits the TTFT
target, the part that missed it: the misses more prefill workers could have
prevented. A prompt too long to meet the target on an idle worker is not counted:
no number of workers would have met it.

One definition, `wait_miss`, which both callers use: the live head
(cluster/orchestration/autoscaler.py: a prompt's prefill alone from the tokens the
prefill worker computed and the per-worker prefill rate the controller is given)
and the simulator (cluster/tools/sim/autoscale.py: from the cost model's
`pure_prefill`, chunk by chunk). `WaitMisses` keeps a window of them. Pure: no
clock of its own, no I/O.
"""
from __future__ import annotations

from collections import deque


def wait_miss(ttft_s: float, prefill_alone_s: float, slo_ttft_s: float) -> float | None:
    """A request's part in the wait-miss fraction: None when its prefill alone does not
    fit the target (not counted); else 1.0 when its TTFT missed the target (it waited),
    0.0 when it met it."""
    if slo_ttft_s <= 0:
        raise ValueError(f"the TTFT target must be positive seconds (--slo-ttft-ms), got {slo_ttft_s}")
    if prefill_alone_s > slo_ttft_s:
        return None
    return 1.0 if ttft_s > slo_ttft_s else 0.0


def prefill_alone_at_rate(computed_tokens: int, tokens_per_s: float) -> float:
    """Seconds a prompt's prefill takes alone on a worker that computes `tokens_per_s`
    prompt tokens a second: the tokens it computed (prompt minus its prefix-cache hit)
    at that rate."""
    if tokens_per_s <= 0:
        raise ValueError(f"a worker's prefill rate must be positive tokens/s, got {tokens_per_s}")
    return max(0, computed_tokens) / tokens_per_s


class WaitMisses:
    """`wait_miss` of each request whose first token came in the last `window_s` seconds
    (the counted ones); `fraction` is the signal."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"the wait-miss window must be positive seconds, got {window_s}")
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque()

    def add(self, t: float, ttft_s: float, prefill_alone_s: float, slo_ttft_s: float) -> None:
        """A first token at time `t`."""
        miss = wait_miss(ttft_s, prefill_alone_s, slo_ttft_s)
        if miss is not None:
            self._items.append((t, miss))

    def fraction(self, now: float) -> float | None:
        """The part of the counted requests of the window that missed; None: none counted."""
        while self._items and self._items[0][0] < now - self.window_s:
            self._items.popleft()
        return sum(m for _, m in self._items) / len(self._items) if self._items else None

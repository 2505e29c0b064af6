"""`OpenSends`: the requests the router sent whose prefill has not ended, kept in flight.

``route()`` records a prompt's blocks as in flight on the node it sent them to
(inflight.py) for ``ttl_s`` (10 s). A prefill queued at the knee waits longer
than that (prefix-aware's p90 TTFT there is 17-22 s); its record lapsed and
the conversation's next turn, seeing no match, recomputed the prefix
elsewhere. So the router keeps each send until its caller says the prefill
ended (``Router.on_prefill_end``) and, before a decision, refreshes the
chains of those still open once half a ``ttl_s`` has passed since the last
refresh: a pending prefill's blocks stay in flight however long it queues.

- Computed: the send is no longer refreshed; its entries lapse ``ttl_s``
  after the last refresh (the node's KV events, which take precedence,
  arrive within a report interval, and the entries may close the chains of
  other pending sends that share their first blocks, so they are not cut).
- Not computed (failed, aborted, given back unstarted): its entries on that
  node go now (``on_removed``), and the other open sends are refreshed at
  the next decision (those sharing a prefix on that node write it back).
- The node died or cleared its cache: its open sends are forgotten (their
  entries are void already: the epoch), never written back.
- A send whose end never comes is refreshed for ``max_s`` at most (the
  cluster passes ``request_timeout``: no request, and so no prefill, is
  pending longer), then lapses.
"""
from __future__ import annotations

from cluster.router.inflight import InFlightPrefixes


class OpenSends:
    def __init__(self, in_flight: InFlightPrefixes, max_s: float) -> None:
        self._in_flight = in_flight
        self._max_s = max_s
        self._open: dict[str, tuple[str, tuple[int, ...], float]] = {}   # request id -> (worker, hashes, sent at)
        self._refresh_at: float | None = None                            # None: nothing open

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def opened(self, request_id: str, worker_id: str, block_hashes: tuple[int, ...], now: float) -> None:
        """``route()`` sent the request's blocks to ``worker_id`` at ``now``."""
        if not block_hashes:
            return
        self._open.pop(request_id, None)             # (routed again: kept in send order)
        self._open[request_id] = (worker_id, block_hashes, now)
        if self._refresh_at is None:
            self._refresh_at = now + self._in_flight.ttl_s / 2

    def ended(self, request_id: str, computed: bool) -> bool:
        """The request's prefill ended; False: no open send of that id (ended already, or lapsed)."""
        sent = self._open.pop(request_id, None)
        if sent is None:
            return False
        if not computed:
            self._in_flight.on_removed(sent[0], sent[1])
            if self._open:
                self._refresh_at = float("-inf")     # what the others share there, written back
        return True

    def keep_alive(self, now: float) -> None:
        """Before a decision: refresh the open sends' chains if half a ttl passed since the last time
        (newest first: a block lost from the table is written back as the latest send's)."""
        if self._refresh_at is None or now < self._refresh_at:
            return
        oldest = now - self._max_s
        self._open = {r: v for r, v in self._open.items() if v[2] > oldest}
        for worker_id, hashes, _ in reversed(self._open.values()):
            self._in_flight.refresh(worker_id, hashes, now)
        self._refresh_at = now + self._in_flight.ttl_s / 2 if self._open else None

    def worker_gone(self, worker_id: str) -> None:
        """The worker died or cleared its cache: its open sends are not refreshed any more."""
        if any(v[0] == worker_id for v in self._open.values()):
            self._open = {r: v for r, v in self._open.items() if v[0] != worker_id}

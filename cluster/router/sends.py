"""`OpenSends`: the requests the router sent whose prefill has not ended, kept in flight.

``route()`` records a prompt's blocks as in flight on the node it sent them to
(inflight.py) for ``ttl_s`` (10 s). A prefill queued at the knee waits longer
than that (prefix-aware's p90 TTFT there is 17-22 s); its record lapsed and
the conversation's next turn, seeing no match, recomputed the prefix
elsewhere. So the router keeps each send until its caller says the prefill
ended (``Router.on_prefill_end``) and refreshes its chain every half
``ttl_s`` until then: a pending prefill's blocks stay in flight however long
it queues.

Each send is refreshed on its own schedule, half a ttl after it was sent or
last refreshed, by the first decision at or past that time (sends are kept
in that order: the due ones are at the front). A decision so refreshes as
many sends as were sent or refreshed in a like span half a ttl before (none
where prefills end sooner than that), not every open send at once:
refreshing them all in one decision paused it 10-30 us per open send, up to
a third of a second with thousands pending (benchmarks/router_stalls.py;
docs/benchmarks.md "The open sends refreshed one by one"). After the router
was idle for more than half a ttl the first decision refreshes every send
due by then.

- Computed: the send is no longer refreshed; its entries lapse ``ttl_s``
  after the last refresh (the node's KV events, which take precedence,
  arrive within a report interval, and the entries may close the chains of
  other pending sends that share their first blocks, so they are not cut).
- Not computed (failed, aborted, given back unstarted): its entries on that
  node go now (``on_removed``), and the open sends that share its first
  block are refreshed at the next decision, newest first (hashes chain
  through their parents, so only those can share any block of it: those on
  that node write back what they share there, the others take back the
  blocks the dropped send had taken from them). Finding them reads every
  open send's first hash (tens of nanoseconds each), once per such end.
- The node died or cleared its cache: its open sends are forgotten (their
  entries are void already: the epoch), never written back.
- A send whose end never comes is refreshed for ``max_s`` at most (the
  cluster passes ``request_timeout``: no request, and so no prefill, is
  pending longer), then lapses.
"""
from __future__ import annotations

from collections import deque

from cluster.router.inflight import InFlightPrefixes


class OpenSends:
    def __init__(self, in_flight: InFlightPrefixes, max_s: float) -> None:
        self._in_flight = in_flight
        self._max_s = max_s
        # request id -> (worker, hashes, sent at, due): refreshed by the first decision at or past due.
        # Plain tuples of ints and strings: the collector stops tracking them (a dataclass per send
        # made every collection walk all open sends: 7 ms a full one at 20 k open).
        self._open: dict[str, tuple[str, tuple[int, ...], float, float]] = {}
        # (due, request id) in due order, as two deques of floats and strings (no tuple a send for
        # the collector to count); an item whose due is not its send's any more (the send ended,
        # was routed again or moved ahead) is skipped when it comes up
        self._dues: deque[float] = deque()
        self._ids: deque[str] = deque()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def opened(self, request_id: str, worker_id: str, block_hashes: tuple[int, ...], now: float) -> None:
        """``route()`` sent the request's blocks to ``worker_id`` at ``now``."""
        if not block_hashes:
            return
        due = now + self._in_flight.ttl_s / 2
        self._open.pop(request_id, None)                         # (routed again: kept in send order)
        self._open[request_id] = (worker_id, block_hashes, now, due)
        self._dues.append(due)
        self._ids.append(request_id)

    def ended(self, request_id: str, computed: bool) -> bool:
        """The request's prefill ended; False: no open send of that id (ended already, or lapsed)."""
        sent = self._open.pop(request_id, None)
        if sent is None:
            return False
        if not computed:
            self._in_flight.on_removed(sent[0], sent[1])
            first = sent[1][0]
            sharing = [r for r, v in self._open.items() if v[1][0] == first]      # in send order
            for r in sharing:                                    # oldest first to the front: the newest leads
                w, hashes, at, _ = self._open[r]
                self._open[r] = (w, hashes, at, float("-inf"))
                self._dues.appendleft(float("-inf"))
                self._ids.appendleft(r)
        return True

    def keep_alive(self, now: float) -> None:
        """Before a decision: refresh the chains of the sends due by ``now`` (see above); one
        pending longer than ``max_s`` is dropped instead."""
        opened, dues, ids = self._open, self._dues, self._ids
        while dues and dues[0] <= now:
            due, request_id = dues.popleft(), ids.popleft()
            sent = opened.get(request_id)
            if sent is None or sent[3] != due:
                continue
            worker_id, hashes, sent_at, _ = sent
            if sent_at <= now - self._max_s:
                del opened[request_id]
                continue
            self._in_flight.refresh(worker_id, hashes, now)
            due = now + self._in_flight.ttl_s / 2
            opened[request_id] = (worker_id, hashes, sent_at, due)
            dues.append(due)
            ids.append(request_id)

    def worker_gone(self, worker_id: str) -> None:
        """The worker died or cleared its cache: its open sends are not refreshed any more."""
        if any(v[0] == worker_id for v in self._open.values()):
            self._open = {r: v for r, v in self._open.items() if v[0] != worker_id}

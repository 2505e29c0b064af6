"""Read-ahead notices that reach a decode worker before their request's reservation.

The frontend asks the decode node to reserve (`DecodeWorker.reserve`) and the prefill
node to prefill at the same time; the prefill node tells the decode node of each block it
completes (`DecodeWorker.read_ahead`). Nothing orders the two: a short prompt's chunks can
all complete while the reserve call still waits for the decode engine's step to end. A
notice with no reservation to read into is kept here, and the reservation, once made,
reads what was kept, in the order it came: the pipelined hand-off does not depend on
which call wins.

Bounded: a notice is kept at most ``keep_seconds`` (the transfer timeout: a reservation
later than that is no longer a race), for at most ``max_requests`` requests (the oldest
go first). A kept notice can be stale (its request was claimed, or its prompt recomputed
since): reads are checked against the handle at the submit (read_ahead.plan_rest), so a
stale one is read again, never trusted. Pure bookkeeping: no I/O, the clock is passed in.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from decode_worker.read_ahead import LayerRange
from kvtransfer.engine import PeerInfo


@dataclass(frozen=True)
class Notice:
    """One `read_ahead` call's arguments: the prefill node completed prompt blocks
    `first_index`.. (its `block_ids`), or only their `layers`."""
    peer: PeerInfo
    first_index: int
    block_ids: tuple[int, ...]
    preemptions: int
    layers: LayerRange | None = None


@dataclass
class _Kept:
    since: float
    notices: list[Notice] = field(default_factory=list)


class EarlyNotices:
    def __init__(self, keep_seconds: float, max_requests: int = 256, max_per_request: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if keep_seconds <= 0 or max_requests < 1 or max_per_request < 1:
            raise ValueError(f"EarlyNotices needs keep_seconds > 0 and max_requests, max_per_request >= 1; "
                             f"got {keep_seconds}, {max_requests}, {max_per_request}")
        self.keep_seconds, self.max_requests, self.max_per_request = keep_seconds, max_requests, max_per_request
        self._clock = clock
        self._kept: dict[str, _Kept] = {}   # insertion order: oldest first

    def keep(self, request_id: str, notice: Notice) -> None:
        """`notice` came before `request_id`'s reservation: keep it for a while."""
        self._prune()
        kept = self._kept.get(request_id)
        if kept is None:
            if len(self._kept) >= self.max_requests:
                self.drop(next(iter(self._kept)))
            kept = self._kept[request_id] = _Kept(self._clock())
        if len(kept.notices) < self.max_per_request:
            kept.notices.append(notice)

    def take(self, request_id: str) -> list[Notice]:
        """`request_id` is reserved now: its kept notices, oldest first (then forgotten)."""
        self._prune()
        kept = self._kept.pop(request_id, None)
        return [] if kept is None else kept.notices

    def drop(self, request_id: str) -> None:
        """No reservation will read these (refused, aborted, claimed, prefilled here)."""
        self._kept.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._kept)

    def _prune(self) -> None:
        limit = self._clock() - self.keep_seconds
        while self._kept:
            rid, kept = next(iter(self._kept.items()))
            if kept.since > limit:
                return
            self.drop(rid)

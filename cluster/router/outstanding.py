"""`OutstandingPrefills`: the prompt tokens this frontend has sent each prefill node to compute
and not yet seen finish, counted exactly and at once (no report in between).

A request routed to a prefill node adds its uncached tokens there (``sent``); the end of its
prefill (first token back, failure, hand-back, abort: ``ended``) takes them off. ``room`` says
whether some live prefill node has at most ``limit`` tokens outstanding: the prefill gate
(cluster/orchestration/prefill_gate.py, and the simulator's copy of it) routes while it holds.
Workers' load reports lag by a report round, more on a loaded host where a busy actor answers
late; this count moves the moment a prefill returns, so a node that finished is given its next
request without waiting for a report.
"""
from __future__ import annotations

from typing import Iterable


class OutstandingPrefills:
    def __init__(self) -> None:
        self._by_request: dict[str, tuple[str, int]] = {}
        self._tokens: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._by_request)

    def sent(self, request_id: str, worker_id: str, tokens: int) -> None:
        """``tokens`` prompt tokens of ``request_id`` to compute on ``worker_id`` (replaces an
        earlier send of the same id)."""
        if tokens < 0:
            raise ValueError(f"request {request_id!r}: tokens to compute must be >= 0, got {tokens}")
        self.ended(request_id)
        self._by_request[request_id] = (worker_id, tokens)
        self._tokens[worker_id] = self._tokens.get(worker_id, 0) + tokens

    def ended(self, request_id: str) -> bool:
        """The prefill of ``request_id`` is over (any way). False if none was outstanding."""
        entry = self._by_request.pop(request_id, None)
        if entry is None:
            return False
        worker_id, tokens = entry
        left = self._tokens[worker_id] - tokens
        if left:
            self._tokens[worker_id] = left
        else:
            del self._tokens[worker_id]
        return True

    def tokens(self, worker_id: str) -> int:
        return self._tokens.get(worker_id, 0)

    def room(self, workers: Iterable[str], limit: int) -> bool:
        """Some worker of ``workers`` (the live prefill nodes) has at most ``limit`` tokens
        outstanding; True when there is none (the router then decides without a prefill node)."""
        seen = False
        for w in workers:
            if self._tokens.get(w, 0) <= limit:
                return True
            seen = True
        return not seen

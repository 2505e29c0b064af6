"""Where each request of one scheduler lives, and the invariants of that.

Live requests are in exactly one place: ``waiting`` (FCFS deque; WAITING or
PREEMPTED, no blocks), ``running`` (sorted by arrival, oldest first, so the
preemption victim is always the last one) or ``remote`` (blocks reserved,
KV arriving from another node). Finished requests whose KV is kept for a
remote reader are ``held`` until released.
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Callable

from engine.block_manager import cdiv
from engine.request import Request, RequestStatus

WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class RequestQueues:
    def __init__(self) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}
        self.held: dict[str, tuple[Request, float]] = {}     # request, held since
        self._live: dict[str, Request] = {}
        # get(request_id) -> Request | None: the dict's own method (read for every
        # scheduled sequence of every step, so no Python frame of ours in between)
        self.get: Callable[[str], Request | None] = self._live.get
        self._arrival: dict[str, tuple[float, int]] = {}     # (arrival_time, admission order)
        self._next = 0

    def register(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._live or rid in self.held:
            raise ValueError(f"request id {rid!r} is already in use; give each request a unique id")
        self._live[rid] = request
        self._arrival[rid] = (request.arrival_time, self._next)
        self._next += 1

    def unregister(self, request_id: str) -> None:
        del self._live[request_id], self._arrival[request_id]

    def live_ids(self) -> list[str]:
        return list(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: self._arrival[r.request_id])

    def remove(self, request: Request) -> None:
        """Take a live request out of its queue and forget it."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.remote[request.request_id]
        else:
            self.waiting.remove(request)
        self.unregister(request.request_id)

    def check(self, block_ids: Callable[[str], list[int]], owners: set[str], block_size: int) -> list[str]:
        errors = []
        ids = [r.request_id for q in (self.running, self.waiting, self.remote.values()) for r in q]
        if len(ids) != len(set(ids)) or set(ids) != set(self._live):
            errors.append(f"queues {sorted(ids)} disagree with live requests {sorted(self._live)}")
        for r in self.running:
            n_blocks = len(block_ids(r.request_id))
            if r.status != RequestStatus.RUNNING or r.num_computed_tokens >= r.num_tokens \
                    or n_blocks < cdiv(r.num_computed_tokens, block_size):
                errors.append(f"running {r.request_id}: {r.status.name}, "
                              f"{r.num_computed_tokens}/{r.num_tokens} tokens, {n_blocks} blocks")
        for r in self.waiting:
            if r.status not in WAITING_STATES or r.num_computed_tokens or block_ids(r.request_id):
                errors.append(f"waiting {r.request_id}: {r.status.name}, {r.num_computed_tokens} computed")
        for r in self.remote.values():
            if r.status != RequestStatus.WAITING_FOR_REMOTE_KV \
                    or len(block_ids(r.request_id)) != cdiv(r.num_prompt_tokens, block_size):
                errors.append(f"remote {r.request_id}: {r.status.name}")
        for rid, (r, _) in self.held.items():
            if not r.status.finished:
                errors.append(f"held {rid} is {r.status.name}")
        keys = [self._arrival[r.request_id] for r in self.running]
        if keys != sorted(keys):
            errors.append("running is not in arrival order")
        stray = owners - {r.request_id for r in self.running} - set(self.remote) - set(self.held)
        if stray:
            errors.append(f"blocks owned by requests not running, remote or held: {sorted(stray)}")
        return errors

"""Queued decode work follows free batch slots.

A hand-off is bound to the decode worker the router picked when the request arrived. When a
burst finds a decode pool too small (one worker, before the autoscaler grows it), the hand-offs
past that worker's batch (``max_num_seqs``) wait on it for room (decode_worker/worker.py), the
prompt's KV still on the prefill node under its lease. Workers that join later would take only
new arrivals and sit idle beside that backlog, and the autoscaler, seeing them idle, would shrink
the pool again with the backlog still waiting.

Every ``decode_rebalance_interval`` seconds this frontend compares its decode workers' reported
loads: free slots on a worker with nothing waiting are ``max_num_seqs - running``. A worker with
requests waiting gives back as many of this frontend's (newest first) as the others have free
slots (``give_back``), each planned for one target:

- a hand-off still waiting there for room (nothing of it allocated there): its submit returns
  ``moved`` + ``given_back`` and it is submitted to the target with the same KV handle, which
  pulls from the prefill node as the first worker would have: nothing is computed twice;
- a request queued in that worker's engine with nothing computed (a hand-off that waited past
  ``transfer_timeout`` and was queued to be recomputed there): aborted there and continued from
  prompt + streamed tokens (as a drained worker's are), decoding on the target; its prompt is
  computed once, as it would have been there.

Requests of other frontends are left to them, and colocated workers' queues too (prompts routed
where their prefix is cached). Counted in ``pdserve_decode_rebalanced_total`` and,
per request, in its journal (``Recovery.REBALANCED``).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from cluster.orchestration.backend import BackendError
from worker_api.messages import GiveBack

if TYPE_CHECKING:
    from cluster.orchestration.handoff import Handoff
    from cluster.orchestration.pool import WorkerPool

log = logging.getLogger("pdserve.cluster")


@dataclass(frozen=True)
class Move:
    source: str      # the decode worker the hand-offs wait on
    target: str      # the one with free slots
    count: int


def plan_moves(loads: Mapping[str, tuple[int, int]], max_num_seqs: int) -> list[Move]:
    """``loads``: decode worker id -> (running, waiting). Moves of waiting hand-offs to free
    slots (``max_num_seqs - running`` on a worker with nothing waiting: one with a free slot
    and a queue is short of KV, not of slots), the longest queue first, each into the target
    with the most free slots; never more than the free slots."""
    free = {w: max_num_seqs - r for w, (r, q) in loads.items() if q == 0 and r < max_num_seqs}
    moves: list[Move] = []
    for source, (_, waiting) in sorted(loads.items(), key=lambda kv: (-kv[1][1], kv[0])):
        left = waiting
        while left > 0 and free:
            target = max(sorted(free), key=free.__getitem__)
            n = min(left, free[target])
            moves.append(Move(source, target, n))
            left -= n
            free[target] -= n
            if not free[target]:
                del free[target]
    return moves


class DecodeRebalancer:
    def __init__(self, pool: WorkerPool, by_wid: Mapping[str, Handoff], max_num_seqs: int,
                 interval: float) -> None:
        self.pool, self.by_wid, self.max_num_seqs, self.interval = pool, by_wid, max_num_seqs, interval

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.tick()
            except Exception:   # a worker that died meanwhile: the next tick sees the new view
                log.exception("decode rebalance failed; trying again in %.1f s", self.interval)

    async def tick(self) -> int:
        """One comparison of the decode workers; the number of hand-offs moved."""
        # decode pools only: a colocated worker's queue is prompts routed to where their prefix is
        # cached, which moving would compute again
        live = {v.worker_id: v.load for v in self.pool.router.view.decode
                if v.pool == "decode" and self.pool.live(v.worker_id) is not None
                and v.worker_id not in self.pool.draining}
        moves = plan_moves({w: (load.running, load.waiting) for w, load in live.items()}, self.max_num_seqs)
        moved = 0
        for move in moves:
            moved += await self._give_back(move)
        return moved

    async def _give_back(self, move: Move) -> int:
        ref = self.pool.live(move.source)
        if ref is None:
            return 0
        # the newest first: a worker starts its queue in arrival order
        waiting = [h for h in reversed(list(self.by_wid.values())) if h.may_wait_on(move.source)]
        chosen = {h.wid: h for h in waiting[:move.count]}
        if not chosen:
            return 0
        for handoff in chosen.values():
            handoff.rebalance_to = move.target
        try:
            given = await self.pool.call(ref, ref.actor.give_back.remote(request_ids=list(chosen)))
        except BackendError:
            given = GiveBack()
        for wid in given.queued:            # aborted there: continued from prompt + streamed tokens
            chosen[wid].moved(move.source, rebalanced=True)
        for wid in set(chosen) - set(given.waiting_for_room) - set(given.queued):
            chosen[wid].rebalance_to = None
        n = len(given.waiting_for_room) + len(given.queued)
        if n:
            log.info("decode rebalance: %d requests waiting on %s go to %s (%d hand-offs waiting for room, "
                     "%d queued to recompute)", n, move.source, move.target, len(given.waiting_for_room),
                     len(given.queued))
        return n

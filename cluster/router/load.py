"""The router's per-worker load state: a worker's periodic report (``LoadReport``,
``load_from_stats``) and what the router adds to it between two reports (``LoadSlot``:
the optimistic accounting described in router.py)."""
from __future__ import annotations

from typing import Protocol

from cluster.router.policy import WorkerLoad, WorkerView


class LoadReport(Protocol):
    """What ``Router.observe_stats`` reads from a worker's periodic stats report
    (the frontend's ``WorkerStats`` has these fields; the router does not import it)."""
    @property
    def worker_id(self) -> str: ...
    @property
    def pool(self) -> str: ...
    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def kv_blocks_used(self) -> int: ...
    @property
    def kv_blocks_total(self) -> int: ...


def load_from_stats(stats: LoadReport, queued_prefill_tokens: int = 0) -> WorkerLoad:
    return WorkerLoad(queued_prefill_tokens=queued_prefill_tokens, running=stats.running,
                      waiting=stats.waiting, kv_usage=stats.kv_blocks_used / max(1, stats.kv_blocks_total))


class LoadSlot:
    """Internal per-worker load state."""
    __slots__ = ("worker_id", "pool", "reported", "pending_tokens", "pending_running",
                 "pending_until", "assigned_tokens", "view")

    def __init__(self, worker_id: str, pool: str) -> None:
        self.worker_id = worker_id
        self.pool = pool
        self.reported = WorkerLoad()
        self.pending_tokens = 0
        self.pending_running = 0
        self.pending_until: float | None = None
        self.assigned_tokens = 0           # prompt tokens routed here to compute, ever (the tie-break)
        self.view = WorkerView(worker_id, pool, self.reported)

    def refresh(self) -> None:
        r = self.reported
        load = r if not (self.pending_tokens or self.pending_running) else WorkerLoad(
            r.queued_prefill_tokens + self.pending_tokens, r.running + self.pending_running,
            r.waiting, r.kv_usage, r.alive)
        self.view = WorkerView(self.worker_id, self.pool, load, self.assigned_tokens)

    def clear_pending(self) -> None:
        self.pending_tokens = self.pending_running = 0
        self.pending_until = None

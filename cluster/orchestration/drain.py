"""Scale-down of one worker: `ClusterBackend.drain_worker(worker_id)`.

Routing to it stops at once (the router sees it as gone and its load reports
no longer revive it); the requests queued on it and not started (a prefill
not begun, a decode-side request still waiting to be scheduled or for KV
room) come back and continue on other workers; the requests it runs finish
there. It then stays up, unrouted, until `undrain_worker` or its removal.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Mapping

from cluster.orchestration.handoff import Handoff
from cluster.orchestration.pool import WorkerPool

log = logging.getLogger("pdserve.cluster")


@dataclass(frozen=True)
class DrainReport:
    worker_id: str
    moved: int                   # queued requests handed back and continued elsewhere
    idle: bool                   # nothing of it in flight any more (False: timed out)
    in_flight: int               # requests still using it when drain_worker returned


async def drain_worker(pool: WorkerPool, by_wid: Mapping[str, Handoff], worker_id: str,
                       timeout: float) -> DrainReport:
    ref = pool.workers.get(worker_id)
    if ref is None:
        raise ValueError(f"unknown worker {worker_id!r}; workers: {sorted(pool.workers)}")
    prefill = ref.pool == "prefill"
    peers = [w for w, r in pool.workers.items() if w != worker_id and r.alive
             and w not in pool.draining and (r.pool == "prefill") == prefill]
    if not peers and not prefill:
        raise ValueError(f"cannot drain {worker_id}: it is the last live decode worker")
    pool.unroute(worker_id)
    moved = await ref.actor.drain.remote()
    for wid in moved:
        handoff = by_wid.get(wid)
        if handoff is not None:
            handoff.moved(worker_id)
    end = time.monotonic() + timeout
    while (left := _using(by_wid, worker_id)) and time.monotonic() < end:
        await asyncio.sleep(0.05)
    log.info("drained %s: %d queued requests moved, %d still in flight", worker_id, len(moved), left)
    return DrainReport(worker_id, len(moved), idle=left == 0, in_flight=left)


async def undrain_worker(pool: WorkerPool, worker_id: str) -> None:
    await pool.workers[worker_id].actor.undrain.remote()
    pool.reroute(worker_id)


def _using(by_wid: Mapping[str, Handoff], worker_id: str) -> int:
    return sum(1 for h in set(by_wid.values()) if h.uses(worker_id))


async def retire_worker(pool: WorkerPool, by_wid: Mapping[str, Handoff], worker_id: str,
                        timeout: float) -> bool:
    """Scale-in: drain the worker, wait until nothing of it is in flight and its leases are
    released, then stop it for good. A worker that does not empty within `timeout` is put
    back into service instead (False): a scale-in never loses or duplicates a request."""
    end = time.monotonic() + timeout
    report = await drain_worker(pool, by_wid, worker_id, timeout)
    if not (report.idle and await _leases_released(pool.workers[worker_id], end)):
        log.warning("retiring %s: not empty after %.0f s; it serves again", worker_id, timeout)
        await undrain_worker(pool, worker_id)
        return False
    pool.remove(worker_id)
    return True


async def _leases_released(ref, end: float) -> bool:
    """A prefill worker's handed-off blocks are all read or released (decode workers hold none)."""
    if ref.pool != "prefill":
        return True
    while (await ref.actor.report.remote()).leases_active:
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(0.05)
    return True

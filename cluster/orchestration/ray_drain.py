"""Scale-down of one worker: `RayClusterBackend.drain_worker(worker_id)`.

Routing to it stops at once (the router sees it as gone and its load reports
no longer revive it); the requests queued on it and not started (a prefill
not begun, a decode-side request still waiting to be scheduled or for KV
room) come back and continue on other workers; the requests it runs finish
there. It then stays up, unrouted, until `undrain_worker` or its removal.
A mixin of RayClusterBackend.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from cluster.orchestration.ray_recovery import Moved

log = logging.getLogger("pdserve.cluster")


@dataclass(frozen=True)
class DrainReport:
    worker_id: str
    moved: int                   # queued requests handed back and continued elsewhere
    idle: bool                   # nothing of it in flight any more (False: timed out)
    in_flight: int               # requests still using it when drain_worker returned


class DrainMixin:
    async def drain_worker(self, worker_id: str, timeout: float = 60.0) -> DrainReport:
        """Scale-down one worker: stop routing to it, move its queued requests to
        other workers, let its running ones finish (up to `timeout` seconds).
        It stays up, unrouted, until `undrain_worker` or its removal."""
        ref = self.workers.get(worker_id)
        if ref is None:
            raise ValueError(f"unknown worker {worker_id!r}; workers: {sorted(self.workers)}")
        role = "prefill" if ref.pool == "prefill" else "decode"
        peers = [w for w, r in self.workers.items() if w != worker_id and r.alive
                 and w not in self.recovery.draining and (r.pool == "prefill") == (role == "prefill")]
        if not peers and role == "decode":
            raise ValueError(f"cannot drain {worker_id}: it is the last live decode worker")
        self.recovery.draining.add(worker_id)
        self.router.on_worker_dead(worker_id)    # unrouted now; its reports no longer revive it
        moved = await ref.actor.drain.remote()
        for wid in moved:
            st = self._by_wid.get(wid)
            if st is not None and st.decode_id == worker_id:
                st.queue.put_nowait(Moved(worker_id))
        end = time.monotonic() + timeout
        while (left := self._using(worker_id)) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        log.info("drained %s: %d queued requests moved, %d still in flight", worker_id, len(moved), left)
        return DrainReport(worker_id, len(moved), idle=left == 0, in_flight=left)

    async def undrain_worker(self, worker_id: str) -> None:
        """Route to a drained worker again (its next report resyncs the router)."""
        await self.workers[worker_id].actor.undrain.remote()
        self.recovery.draining.discard(worker_id)

    def _using(self, worker_id: str) -> int:
        return sum(1 for st in self._inflight.values() if worker_id in (st.decode_id, st.prefill_id))

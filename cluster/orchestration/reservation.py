"""Decode blocks reserved while the prompt is prefilled (`reserve_decode_blocks`): the
submit after the prefill then pulls at once instead of first waiting an engine step for
room. A reservation no submit claims is freed: by the request here (abort, a first token
that ends it, a submit elsewhere) or, should this frontend vanish, by the decode worker's
own expiry.

Each reserve call's outcome is counted (`pdserve_decode_reservations_total{outcome}`, beside
the hand-offs the rule skipped, cluster/orchestration/handoff.py): `reserved`, `refused` (the
decode node reserved nothing: no room, queue full, draining) or `failed` (the call failed, or
the decode worker was gone). A reserve call cancelled with its request counts nothing."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

from cluster.orchestration.backend import BackendError, GenerateJob
from cluster.orchestration.pool import WorkerPool
from cluster.orchestration.work_items import work_item


@dataclass
class Reservation:
    worker_id: str                 # the decode worker holding the blocks until a submit claims them
    task: asyncio.Task             # -> True once reserved

    @classmethod
    def start(cls, pool: WorkerPool, wid: str, job: GenerateJob, decode_id: str | None,
              outcome: Callable[[str], None]) -> Reservation | None:
        """Ask `decode_id` to reserve; `outcome` is told what became of the call."""
        ref = pool.live(decode_id)
        if ref is None:
            outcome("failed")
            return None

        async def reserve() -> bool:
            try:
                reserved = bool(await pool.call(ref, ref.actor.reserve.remote(item=work_item(job, wid))))
            except BackendError:   # dead or slow: the submit finds out and allocates as before
                outcome("failed")
                return False
            outcome("reserved" if reserved else "refused")
            return reserved
        return cls(ref.worker_id, asyncio.get_running_loop().create_task(reserve()))

    async def settle(self, pool: WorkerPool, wid: str, decode_id: str | None) -> None:
        """Before a submit to `decode_id` (None: no submit follows): wait for the blocks to
        be reserved; a reservation on another worker is freed."""
        free, reserved = self.worker_id != decode_id, False
        try:
            reserved = await self.task
        except asyncio.CancelledError:   # no submit follows: free whatever was reserved
            free = reserved = True
            raise
        except Exception:
            pass
        finally:
            ref = pool.live(self.worker_id)
            if free and reserved and ref is not None:
                pool.background(ref.actor.abort.remote(request_id=wid))

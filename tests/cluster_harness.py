"""A real pdserve stack (Ray actors, gRPC, metrics) on its own event-loop thread."""
from __future__ import annotations

import asyncio
import time
import urllib.request

from cluster.config import ServeConfig
from cluster.server_stack import ServerStack, start_stack
from grpc_harness import LoopThread, free_port  # noqa: F401 (re-exported for the e2e tests)


class Cluster:
    """`start_stack(cfg)` on a loop thread. ``keep_ray``: the process's Ray runtime outlives the
    cluster (a module's fixture started it for several clusters: a Ray start and stop is ~7 s
    here); without it the cluster's close shuts Ray down."""

    def __init__(self, cfg: ServeConfig, *, keep_ray: bool = False) -> None:
        self.keep_ray = keep_ray
        self.loop = LoopThread()
        try:
            self.stack: ServerStack = self.loop.run(start_stack(cfg), timeout=300)
        except BaseException:
            # start_stack stops what it started; a start still running (it timed out) is cancelled
            # into doing so. This process's Ray goes too, so the next module's cluster starts its
            # own instead of joining this one's.
            self._shutdown()
            raise
        self.backend = self.stack.backend

    @property
    def target(self) -> str:
        return self.stack.grpc.target

    def call(self, worker_id: str, method: str, *args):
        """Call a worker actor's method by name, from the test's thread."""
        actor = self.backend.workers[worker_id].actor

        async def call():
            return await getattr(actor, method).remote(*args)
        return self.loop.run(call())

    def sample(self, name: str, **labels) -> float:
        return self.stack.metrics.registry.get_sample_value(name, labels) or 0.0

    def scrape(self) -> str:
        with urllib.request.urlopen(self.stack.metrics_server.url, timeout=10) as r:
            return r.read().decode()

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Until every worker holds no blocks and runs nothing; integrity checked."""
        end = time.monotonic() + timeout
        while True:
            states = {w: self.call(w, "check_integrity") for w in self.backend.workers}
            if all(s.kv_blocks_used == 0 and s.running == 0 and s.leases == 0
                   for s in states.values()):
                return states
            assert time.monotonic() < end, f"workers not idle: {states}"
            time.sleep(0.1)

    def settle(self, timeout: float = 120.0) -> dict:
        """Every worker back (Ray restarts a killed one) and idle: no block or lease left."""
        import ray

        end = time.monotonic() + timeout
        while True:
            try:
                return self.wait_idle(timeout)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):   # still restarting
                assert time.monotonic() < end, "a killed worker never came back"
                time.sleep(0.5)

    def close(self) -> None:
        try:
            self.loop.run(self.stack.drain_and_stop(1.0))
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        """Cancel what is left on the loop (nothing on it calls Ray after the shutdown), then Ray
        and the loop go."""
        import ray
        try:
            self.loop.run(_cancel_pending(), timeout=60)
        finally:
            if not self.keep_ray:
                ray.shutdown()
            self.loop.close()


async def _cancel_pending() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=30)

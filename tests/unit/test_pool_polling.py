"""The head's report poll (cluster/orchestration/pool.py `_poll_reports`): one worker whose
KV snapshot never answers (a link back from a partition with the reply lost) must not stop
the poll, which awaits every worker's report together. A real in-process PrefillWorker
(tiny model, tcp transfer engine) behind a handle that calls it as Ray would, no Ray."""
from __future__ import annotations

import asyncio

from cluster.config import ServeConfig
from cluster.observability.metrics import Metrics
from cluster.orchestration import pool as pool_mod
from cluster.orchestration.launcher import WorkerRef
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.kv_events import KVEvent, KVEventKind
from kvtransfer.settings import TransferSettings


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, **kw):
        return self.fn(**kw)


class _Handle:
    """`handle.method.remote(**kw)` awaits the worker's own method; kv_snapshot hangs while
    `hang` is set (the call never returns, as a reply lost on a cut link)."""
    def __init__(self, worker):
        self.worker, self.hang, self.snapshots = worker, True, 0

    def __getattr__(self, name):
        if name == "kv_snapshot":
            return _Method(self._snapshot)
        return _Method(getattr(self.worker, name))

    async def _snapshot(self):
        self.snapshots += 1
        if self.hang:
            self.hang = False          # the next call answers
            await asyncio.Event().wait()
        return await self.worker.kv_snapshot()


def test_a_hanging_snapshot_does_not_stop_the_poll(tiny_llama_dir, monkeypatch):
    from prefill_worker.worker import PrefillWorker

    monkeypatch.setattr(pool_mod, "SNAPSHOT_TIMEOUT_S", 0.3)
    cfg = EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                       scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=256))
    handle = _Handle(PrefillWorker("prefill-0", cfg, TransferSettings(backend="tcp", lease_ttl=60.0, timeout=60.0)))

    async def go():
        pool = pool_mod.WorkerPool(ServeConfig(), Metrics(), report_interval=0.05)
        pool.router.add_worker("prefill-0", "prefill")
        pool.workers["prefill-0"] = WorkerRef("prefill-0", "prefill", handle, alive=False)   # marked dead
        task = asyncio.get_running_loop().create_task(pool._poll_reports())
        try:
            for _ in range(100):       # 5 s
                if "prefill-0" in pool.stats:   # a report observed after the hang
                    return handle.snapshots
                await asyncio.sleep(0.05)
            return None
        finally:
            pool._stopping = True
            task.cancel()

    snapshots = asyncio.run(go())
    assert snapshots is not None, "no report was observed after the hanging snapshot: the poll stopped there"
    assert snapshots >= 1


def test_report_poll_backs_off_only_while_every_worker_is_quiet():
    """Idle, the wait doubles from the base interval up to the cap; any round with work (or a
    routed request, which ends the wait) brings it back to the base at once."""
    base, cap = 0.1, pool_mod.IDLE_REPORT_INTERVAL_S
    wait, waits = base, []
    for _ in range(6):
        wait = pool_mod.next_report_interval(wait, True, base, cap)
        waits.append(wait)
    assert waits == [0.2, 0.4, 0.8, cap, cap, cap]
    assert pool_mod.next_report_interval(cap, False, base, cap) == base
    assert pool_mod.next_report_interval(base, True, 2.0, cap) == 2.0   # a base above the cap wins


def test_a_report_is_quiet_only_with_nothing_running_queued_leased_or_changed(tiny_llama_dir):
    from dataclasses import replace

    from prefill_worker.worker import PrefillWorker

    cfg = EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                       scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=256))
    worker = PrefillWorker("prefill-0", cfg, TransferSettings(backend="tcp", lease_ttl=60.0, timeout=60.0))
    report = asyncio.run(worker.report())        # a fresh worker: nothing to do
    assert pool_mod.quiet_report(report)
    event = KVEvent(1, KVEventKind.STORED, (7,))
    for busy in (replace(report, stats=replace(report.stats, running=1)),
                 replace(report, stats=replace(report.stats, waiting=2)),
                 replace(report, leases_active=1), replace(report, events=(event,))):
        assert not pool_mod.quiet_report(busy)


class _Launcher:
    """`create` hands out the in-process worker's handle; `wait_ready` returns at once (it is ready)."""
    def __init__(self, handle):
        self.handle = handle

    def create(self, pool: str) -> WorkerRef:
        return WorkerRef("prefill-1", pool, self.handle, alive=True)

    async def wait_ready(self, refs) -> None:
        return None


def test_a_grown_worker_is_held_from_its_start_and_routed_from_its_first_report(tiny_llama_dir):
    """Between `grow`'s end and the worker's first report the worker is not routed (`serving`) but
    the pool holds it (`held`): the autoscaler counts it there, or it would see one worker fewer and
    grow past a fleet cap (the e2e autoscale test's 5 workers under a cap of 4)."""
    from prefill_worker.worker import PrefillWorker

    cfg = EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                       scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=256))
    handle = _Handle(PrefillWorker("prefill-1", cfg, TransferSettings(backend="tcp", lease_ttl=60.0, timeout=60.0)))
    handle.hang = False

    async def go():
        pool = pool_mod.WorkerPool(ServeConfig(), Metrics(), report_interval=0.05)
        pool._launcher = _Launcher(handle)
        await pool.grow("prefill")
        before = (pool.serving("prefill"), pool.held("prefill"), pool.held("decode"))
        task = asyncio.get_running_loop().create_task(pool._poll_reports())
        try:
            for _ in range(100):       # 5 s
                if pool.serving("prefill"):
                    break
                await asyncio.sleep(0.05)
            return before, (pool.serving("prefill"), pool.held("prefill"), set(pool.joining))
        finally:
            pool._stopping = True
            task.cancel()

    before, after = asyncio.run(go())
    assert before == ([], ["prefill-1"], [])
    assert after == (["prefill-1"], ["prefill-1"], set())

"""asyncio face of an engine running on its own thread (EngineLoop).

Hosts use it in three ways: `call(fn)` runs fn(engine) between steps;
`subscribe(request_id)` gives a per-request queue of StepDeltas (local
serving, prefill workers); `step_batches()` yields every step's deltas as
one list (decode workers stream these to the frontend: one message per
engine step, not one per token per request).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Callable, TypeVar

from engine.engine_loop import EngineLoop
from engine.kv_events import KVEvent
from engine.llm_engine import EngineStats, LLMEngine
from engine.outputs import StepDelta
from engine.step_trace import StepTrace

T = TypeVar("T")


@dataclass(frozen=True)
class EngineReport:
    """The engine's load as of its last step, and the KV events since the last report."""
    stats: EngineStats
    events: tuple[KVEvent, ...]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, batch_stream: bool = False, idle_integrity_check: bool = True):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._batches: asyncio.Queue | None = asyncio.Queue() if batch_stream else None
        self._aloop: asyncio.AbstractEventLoop | None = None
        idle: Callable[[LLMEngine], None] | None = (lambda e: e.check_integrity()) if idle_integrity_check else None
        size = engine.config.step_trace_size
        self._loop = EngineLoop(engine, self._on_deltas, idle_callback=idle,
                                step_trace=StepTrace(size) if size else None)

    async def start(self) -> None:
        if self._aloop is None:
            self._aloop = asyncio.get_running_loop()
            self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        await self.start()
        return await asyncio.wrap_future(self._loop.call(fn))

    def post(self, fn: Callable[[LLMEngine], T]):
        """Queue fn(engine) from any thread without awaiting it (a concurrent Future)."""
        return self._loop.call(fn)

    def subscribe(self, request_id: str) -> asyncio.Queue:
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is in flight; use a unique id")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def step_batches(self) -> AsyncIterator[list[StepDelta]]:
        assert self._batches is not None, "create the AsyncEngine with batch_stream=True"
        while True:
            yield await self._batches.get()

    async def report(self) -> EngineReport:
        """Load and KV events as of the last step: answers at once even mid-step."""
        await self.start()
        stats, events = self._loop.snapshot()
        return EngineReport(stats=stats, events=tuple(events))

    def step_trace(self) -> dict:
        """The steps recorded since the last call (EngineConfig.step_trace_size > 0), as JSON-able dicts."""
        trace = self._loop.step_trace
        if trace is None:
            return {"enabled": False, "records": [], "dropped": 0}
        return {"enabled": True, "records": [r.to_json() for r in trace.drain()], "dropped": trace.dropped}

    def _on_deltas(self, deltas: list[StepDelta]) -> None:   # on the engine thread
        assert self._aloop is not None
        self._aloop.call_soon_threadsafe(self._dispatch, deltas)

    def _dispatch(self, deltas: list[StepDelta]) -> None:
        if self._batches is not None:
            self._batches.put_nowait(deltas)
        for d in deltas:
            q = self._queues.get(d.request_id)
            if q is not None:
                q.put_nowait(d)

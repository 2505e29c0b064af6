"""LocalEngineBackend: the model runs in this process (no Ray).

Used by `pdserve generate` without `--target`, by `pdserve serve --no-ray`
on a laptop, and by frontend tests. The engine runs on its own thread
(engine.engine_loop.EngineLoop); deltas are fanned out to per-request
asyncio queues on the caller's event loop.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from cluster.backend import BackendError, GenerateJob, GenerationBackend, ModelInfoData
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.outputs import StepDelta


class LocalEngineBackend(GenerationBackend):
    def __init__(self, engine_config: EngineConfig | None = None, *, engine: LLMEngine | None = None,
                 model_name: str | None = None) -> None:
        self.engine = engine or LLMEngine(engine_config or EngineConfig(model=""))
        self._model_name = model_name or self.engine.model_path.name
        self._queues: dict[str, asyncio.Queue] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._loop = EngineLoop(self.engine, self._on_deltas, idle_callback=lambda e: e.check_integrity())

    async def start(self) -> None:
        self._aloop = asyncio.get_running_loop()
        self._loop.start()

    async def stop(self) -> None:
        self._loop.stop()

    def _on_deltas(self, deltas: list[StepDelta]) -> None:
        assert self._aloop is not None
        self._aloop.call_soon_threadsafe(self._dispatch, deltas)

    def _dispatch(self, deltas: list[StepDelta]) -> None:
        for d in deltas:
            q = self._queues.get(d.request_id)
            if q is not None:
                q.put_nowait(d)

    async def call(self, fn):
        """Run fn(engine) on the engine thread (tests use it to inspect the engine)."""
        return await asyncio.wrap_future(self._loop.call(fn))

    async def generate(self, job: GenerateJob) -> AsyncIterator[StepDelta]:
        if self._aloop is None:
            await self.start()
        rid = job.request_id
        if rid in self._queues:
            raise BackendError("ALREADY_EXISTS", f"request id {rid!r} is in flight; use a unique id")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        done = False
        try:
            try:
                await self.call(lambda e: e.add_request(rid, job.prompt_token_ids, job.sampling, job.cache_salt,
                                                        arrival_time=job.arrival_time))
            except ValueError as e:
                raise BackendError("INVALID_ARGUMENT", str(e)) from e
            remaining = job.sampling.n
            while remaining:
                delta = await _get(queue, job.deadline)
                if delta.finish_reason:
                    remaining -= 1
                done = remaining == 0
                yield delta
        finally:
            self._queues.pop(rid, None)
            if not done:
                await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        await self.call(lambda e: e.abort_request(request_id))

    def model_info(self) -> ModelInfoData:
        e = self.engine
        return ModelInfoData(self._model_name, e.max_model_len, e.block_size, e.tokenizer.vocab_size,
                             {"colocated": 1})

    def tokenizer(self):
        return self.engine.tokenizer


async def _get(queue: asyncio.Queue, deadline: float | None) -> StepDelta:
    if deadline is None:
        return await queue.get()
    timeout = deadline - time.monotonic()
    if timeout <= 0:
        raise BackendError("DEADLINE_EXCEEDED", "the request's deadline passed before it finished")
    try:
        return await asyncio.wait_for(queue.get(), timeout)
    except asyncio.TimeoutError:
        raise BackendError("DEADLINE_EXCEEDED", "the request's deadline passed before it finished") from None

"""LocalEngineBackend: the model runs in this process (no Ray).

Used by `pdserve generate` without `--target`, by `pdserve serve --no-ray`
on a laptop, and by frontend tests. The engine runs on its own thread;
deltas are fanned out to per-request asyncio queues.
"""
from __future__ import annotations

from typing import AsyncIterator

from cluster.orchestration.backend import BackendError, GenerateJob, GenerationBackend, ModelInfoData
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, QueueFull
from engine.outputs import StepDelta


class LocalEngineBackend(GenerationBackend):
    def __init__(self, engine_config: EngineConfig | None = None, *, engine: LLMEngine | None = None,
                 model_name: str | None = None) -> None:
        self.engine = engine or LLMEngine(engine_config or EngineConfig(model=""))
        self._model_name = model_name or self.engine.model_path.name
        self._async = AsyncEngine(self.engine)

    async def start(self) -> None:
        await self._async.start()

    async def stop(self) -> None:
        self._async.stop()

    async def call(self, fn):
        """Run fn(engine) on the engine thread (tests use it to inspect the engine)."""
        return await self._async.call(fn)

    async def generate(self, job: GenerateJob) -> AsyncIterator[StepDelta]:
        rid = job.request_id
        try:
            queue = self._async.subscribe(rid)
        except ValueError as e:
            raise BackendError("ALREADY_EXISTS", str(e)) from e
        done = False
        try:
            try:
                await self.call(lambda e: e.add_request(rid, job.prompt_token_ids, job.sampling, job.cache_salt,
                                                        arrival_time=job.arrival_time))
            except ValueError as e:
                raise BackendError("INVALID_ARGUMENT", str(e)) from e
            except QueueFull as e:
                raise BackendError("RESOURCE_EXHAUSTED", str(e), retry_after_s=1.0) from e
            remaining = job.sampling.n
            while remaining:
                delta = await queue.get()
                if delta.finish_reason:
                    remaining -= 1
                done = remaining == 0
                yield delta
        finally:
            self._async.unsubscribe(rid)
            if not done:
                await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        await self.call(lambda e: e.abort_request(request_id))

    def model_info(self) -> ModelInfoData:
        e = self.engine
        return ModelInfoData(self._model_name, e.max_model_len, e.block_size, e.vocab_size,
                             {"colocated": 1}, tokenizer_vocab_size=e.tokenizer.vocab_size,
                             kv_cache_dtype=e.runner.kv_pool.kv_cache_dtype)

    def tokenizer(self):
        return self.engine.tokenizer

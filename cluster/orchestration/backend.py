"""What the frontends (gRPC, HTTP) need from whatever runs the model.

A frontend validates and tokenizes a request into a `GenerateJob`, then
iterates `backend.generate(job)`: one `StepDelta` (engine/outputs.py) per
engine step that produced tokens for this request, the last one carrying
`finish_reason`. Detokenization and stop-string checks happen in the engine
that decides when to stop (the decode node), so deltas carry text.

Implementations: `LocalEngineBackend` (an engine in this process, for
`pdserve generate` without a server and for tests) and `ClusterBackend`
(router + prefill/decode actor pools).
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from engine.outputs import StepDelta
from engine.sampling_params import SamplingParams


class BackendError(Exception):
    """A request could not be served. `code` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class GenerateJob:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str | None = None
    block_hashes: tuple[int, ...] = ()     # chained hashes of the prompt's full blocks
    deadline: float | None = None          # time.monotonic(); enforced by the runner (frontends/runner.py) alone
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class ModelInfoData:
    model_name: str
    max_model_len: int
    block_size: int
    vocab_size: int                        # ids a prompt may hold: 0..vocab_size-1 (the model's embedding rows)
    pools: dict[str, int]                  # pool name -> number of workers
    tokenizer_vocab_size: int = 0          # ids the tokenizer has text for (<= vocab_size when padded)
    kv_cache_dtype: str = "auto"           # folded into block hashes (engine.block_hash.root_hash)


class GenerationBackend(abc.ABC):
    @abc.abstractmethod
    def generate(self, job: GenerateJob) -> AsyncIterator[StepDelta]:
        """Stream the job's deltas. Raises BackendError (e.g. RESOURCE_EXHAUSTED,
        UNAVAILABLE, INVALID_ARGUMENT). Closing the iterator early aborts the
        request and frees its blocks everywhere."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; idempotent."""

    @abc.abstractmethod
    def model_info(self) -> ModelInfoData: ...

    @abc.abstractmethod
    def tokenizer(self):
        """The engine.tokenizer.Tokenizer of the served model (frontends tokenize)."""

    async def start(self) -> None:  # pragma: no cover - default no-op
        return None

    async def stop(self) -> None:  # pragma: no cover - default no-op
        return None

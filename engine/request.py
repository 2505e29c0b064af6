"""One sequence's state inside an engine: tokens, progress and status.

The scheduler thinks in tokens, not phases: a request has
``num_computed_tokens`` (KV already in the pool) and ``num_tokens`` (prompt +
generated). Chunked prefill, decode and "KV arrived from a remote node" are
all "compute the tokens between the two".
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from engine.sampling_params import SamplingParams


class RequestStatus(str, Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"      # eos, stop token or stop string
    FINISHED_LENGTH = "finished_length"        # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"      # cancelled / deadline / error

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # chained hashes of every full block of all_token_ids (extended as tokens append)
    block_hashes: list[int] = field(default_factory=list)
    # prompt tokens found in the prefix cache the first time it was scheduled
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    # index among n>1 samples of one prompt (0 for n == 1)
    sample_index: int = 0
    stop_reason: int | str | None = None
    # prefill role: when finished, keep the blocks (for a remote reader) until
    # the scheduler is told to release them
    hold_kv_on_finish: bool = False
    # tokens the engine must not exceed (prompt + output), set from max_model_len
    max_total_tokens: int | None = None
    # the prompt as native uint32 bytes (engine.block_hash.packed_tokens), for block
    # hashes and the prefix cache's token check: packed once, on first use, unless given
    prompt_packed: bytes | None = field(default=None, repr=False)
    # prompt_packed cut into the KV manager's full blocks, one bytes object each: what the
    # prefix cache keeps per cached block. Cut on first use, unless given (requests with one
    # prompt then share the bytes: the simulator's overlaid copies)
    prompt_blocks: tuple[bytes, ...] | None = field(default=None, repr=False)
    # len(prompt_token_ids), read on every scheduler step (the prompt never changes)
    _num_prompt: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token or a non-empty string")
        self._num_prompt = len(self.prompt_token_ids)
        if self.prompt_packed is not None and len(self.prompt_packed) != 4 * len(self.prompt_token_ids):
            raise ValueError(f"request {self.request_id!r}: prompt_packed holds {len(self.prompt_packed)} bytes "
                             f"for {len(self.prompt_token_ids)} prompt tokens; pass "
                             "engine.block_hash.packed_tokens(prompt_token_ids) or leave it None")

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self._num_prompt + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

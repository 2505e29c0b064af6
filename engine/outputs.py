"""Result objects the engine returns to callers."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token_id, logprob) of top-k alternatives


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None       # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None   # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """One prompt's result. ``token_ids``/``text``/``finish_reason`` mirror the
    first completion (n == 1 convenience); ``outputs`` holds all n."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass(frozen=True)
class StepDelta:
    """New tokens of one sequence produced by one engine step (streaming)."""
    request_id: str
    new_token_ids: tuple[int, ...]
    index: int = 0                      # which of the n samples (n > 1)
    new_text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_seconds: float | None = None  # on a sequence's first token: arrival -> first scheduled
    held_block_ids: tuple[int, ...] = ()  # a prefill_only request's finish: the blocks it holds for a reader
    # a prefill_only request's step that computed a prompt chunk but no token (new_token_ids empty):
    # the prompt blocks whose KV is complete so far, in order (a pipelined hand-off reads them now)
    computed_block_ids: tuple[int, ...] = ()
    # with computed_block_ids, > 0: only layers [0, computed_layers) of those blocks are complete. Sent
    # during the forward of the step that completes a prefill_only prompt (EngineConfig.prompt_layer_groups),
    # for all its prompt blocks, the partial last one included; 0: every layer of them is complete
    computed_layers: int = 0
    preemptions: int = 0                # prefill_only: times it was preempted (its blocks recomputed) so far
    # decode role, tokenless: a handed-off request joined the running batch (its KV is in, and the
    # step now running computes its next token); sent when the step is scheduled, before its forward
    admitted: bool = False

"""Decide, token by token, whether a sequence is finished, and which text a
streaming client may see now.

Checks, in order, after each new token:
1. stop strings, searched only in the text not yet emitted (the new text
   plus at most ``longest stop string - 1`` held-back characters); the one
   completed first wins (earliest end, then earliest start); the stop
   string and everything after it are cut unless
   ``include_stop_str_in_output`` -> finish_reason "stop", stop_reason = the
   string;
2. eos (one of the tokenizer's eos ids, unless ``ignore_eos``) -> "stop",
   stop_reason None;
3. ``stop_token_ids`` -> "stop", stop_reason = the token id;
4. ``max_tokens`` output tokens, or prompt + output reaching
   ``max_total_tokens`` (max_model_len) -> "length".

While running, the longest suffix of the text that could be the start of a
stop string is held back, so a client never sees a partial stop string that
is later trimmed; when the sequence ends for another reason it is released.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopResult:
    finished: bool
    text: str = ""                        # text to emit now
    finish_reason: str | None = None      # "stop" | "length" | None
    stop_reason: int | str | None = None  # stop token id or stop string (None for eos / length)


class StreamingDetokenizer(Protocol):
    def step(self, new_token_ids: Sequence[int]) -> str: ...
    def flush(self) -> str: ...


class StopChecker:
    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int], *,
                 num_prompt_tokens: int = 0, max_total_tokens: int | None = None) -> None:
        if num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")
        if max_total_tokens is not None and num_prompt_tokens >= max_total_tokens:
            raise ValueError(f"the prompt has {num_prompt_tokens} tokens but the model accepts at most "
                             f"{max_total_tokens} (prompt + output): shorten the prompt")
        self.params = params
        self._eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._stops = params.stop
        self._num_prompt = num_prompt_tokens
        self._max_total = max_total_tokens
        self._num_output = 0
        self._pending = ""          # text received but not yet emitted
        self._emitted: list[str] = []
        self.result: StopResult | None = None  # the finishing result, once finished

    @property
    def finished(self) -> bool:
        return self.result is not None

    @property
    def num_output_tokens(self) -> int:
        return self._num_output

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    def token_finishes(self, token_id: int) -> bool:
        """Would ``token_id``, appended next, end the sequence on token grounds
        (eos, stop token, length)? Pure: lets the caller flush its detokenizer
        before calling :meth:`step` with the final text."""
        return self._token_stop(token_id, self._num_output + 1) is not None

    def process(self, token_id: int, detokenizer: StreamingDetokenizer) -> StopResult:
        """Detokenize ``token_id`` (flushing the detokenizer on a token-level
        stop) and :meth:`step`. The usual one call per new token."""
        text = detokenizer.step([token_id])
        if self.token_finishes(token_id):
            text += detokenizer.flush()
        return self.step(token_id, text)

    def step(self, token_id: int, new_text: str) -> StopResult:
        """Account for one appended token whose detokenized text is ``new_text``."""
        if self.result is not None:
            raise ValueError("the sequence already finished "
                             f"({self.result.finish_reason}); do not append more tokens")
        self._num_output += 1
        self._pending += new_text
        if self._stops:
            hit = self._find_stop()
            if hit is not None:
                idx, stop = hit
                end = idx + len(stop) if self.params.include_stop_str_in_output else idx
                return self._finish(self._pending[:end], "stop", stop)
        token_stop = self._token_stop(token_id, self._num_output)
        if token_stop is not None:
            return self._finish(self._pending, *token_stop)
        hold = self._holdback_len() if self._stops else 0
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        self._emitted.append(out)
        return StopResult(False, out)

    # ------------------------------------------------------------ internals
    def _token_stop(self, token_id: int, num_output: int) -> tuple[str, int | None] | None:
        if token_id in self._eos:
            return "stop", None
        if token_id in self._stop_ids:
            return "stop", token_id
        if num_output >= self.params.max_tokens:
            return "length", None
        if self._max_total is not None and self._num_prompt + num_output >= self._max_total:
            return "length", None
        return None

    def _finish(self, text: str, reason: str, stop_reason: int | str | None) -> StopResult:
        self._pending = ""
        self._emitted.append(text)
        self.result = StopResult(True, text, reason, stop_reason)
        return self.result

    def _find_stop(self) -> tuple[int, str] | None:
        """The stop string completed first in the pending text: earliest end,
        then earliest start. Char-by-char streaming would stop at the same
        place, so the result does not depend on how text arrives in chunks."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            i = self._pending.find(stop)
            if i >= 0 and (best is None or (i + len(stop), i) < best[:2]):
                best = (i + len(stop), i, stop)
        return None if best is None else (best[1], best[2])

    def _holdback_len(self) -> int:
        """Length of the longest suffix of the pending text that is a proper
        prefix of some stop string."""
        text, best = self._pending, 0
        if not text:
            return 0
        last = text[-1]
        for stop in self._stops:
            # candidate prefix lengths k end with the text's last character
            k = stop.rfind(last, 0, min(len(stop) - 1, len(text))) + 1
            while k > best:
                if text.endswith(stop[:k]):
                    best = k
                    break
                k = stop.rfind(last, 0, k - 1) + 1
        return best

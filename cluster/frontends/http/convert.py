"""OpenAI request fields -> `GenerateInput`; runner `Chunk`s -> usage and logprobs.

The transport-neutral validator (cluster/frontends/validation.py) does every range
check; this module only moves fields across and rejects what pdserve does
not implement, naming the field.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Sequence

from cluster.frontends.http.errors import OpenAIError
from cluster.frontends.http.openai_schema import (ChatTokenLogprob, CompletionLogprobs, PromptTokensDetails,
                                        SamplingFields, TopLogprob, Usage)
from cluster.frontends.runner import Chunk
from cluster.frontends.validation import SamplingInput, ValidationError
from engine.outputs import TokenLogprob


def bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param, outcome="invalid_argument")


def max_tokens_of(req: SamplingFields, default: int | None) -> int | None:
    """`max_completion_tokens` wins over the older `max_tokens` (as in OpenAI's chat API)."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return default if req.max_tokens is None else req.max_tokens


def renames(req: SamplingFields, logprobs_field: str = "logprobs") -> dict[str, str]:
    """Validator field -> the request field it came from."""
    out = {"logprobs": logprobs_field}
    if req.max_completion_tokens is not None:
        out["max_tokens"] = "max_completion_tokens"
    return out


def sampling_input(req: SamplingFields, *, logprobs: int | None, default_max_tokens: int | None) -> SamplingInput:
    if req.logit_bias:
        raise bad("logit_bias", "not supported by pdserve; remove it")
    return SamplingInput(
        max_tokens=max_tokens_of(req, default_max_tokens), temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, seed=req.seed, n=req.n,
        stop=() if req.stop is None else ((req.stop,) if isinstance(req.stop, str) else tuple(req.stop)),
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, logprobs=logprobs,
        repetition_penalty=req.repetition_penalty, frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty, include_stop_str_in_output=req.include_stop_str_in_output)


async def merged(streams: Sequence[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """(prompt index, chunk) of several runner streams in arrival order. Closing this iterator
    (or cancelling its consumer) closes every stream, which aborts their requests."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as s:
            async for c in s:
                yield 0, c
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=64 * len(streams))

    async def pump(i: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async with contextlib.aclosing(stream) as s:
                async for c in s:
                    await queue.put((i, c))
            await queue.put((i, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if isinstance(e, ValidationError):
                e.prompt_index = i      # "prompt[i]" in the 400's param
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            _, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield _, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class UsageTally:
    """Token counts of a request's prompts and sequences, from their chunks."""

    def __init__(self, num_prompts: int) -> None:
        self.prompt = [0] * num_prompts
        self.cached = [0] * num_prompts
        self.completion: dict[tuple[int, int], int] = {}

    def add(self, p: int, c: Chunk) -> None:
        self.prompt[p] = c.prompt_tokens
        self.cached[p] = max(self.cached[p], c.cached_tokens)
        self.completion[(p, c.index)] = c.completion_tokens

    def usage(self) -> Usage:
        prompt, completion = sum(self.prompt), sum(self.completion.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached)))


class TokenText:
    """Token id -> its text as the client sees it (cached per request), or "token_id:<id>"
    with `return_tokens_as_token_ids` (exact even where one token is part of a character)."""

    def __init__(self, tokenizer, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s


def completion_logprobs(lps: Sequence[TokenLogprob], text: TokenText, offset: int = 0) -> CompletionLogprobs:
    """Legacy completions format; top_logprobs holds the top-k and the sampled token."""
    out = CompletionLogprobs(top_logprobs=[])
    for lp in lps:
        tok = text(lp.token_id)
        out.tokens.append(tok)
        out.token_logprobs.append(lp.logprob)
        out.text_offset.append(offset)
        offset += len(tok)
        top = {text(t): v for t, v in lp.top}
        top.setdefault(tok, lp.logprob)
        out.top_logprobs.append(top)
    return out


def extend_completion_logprobs(acc: CompletionLogprobs, more: CompletionLogprobs) -> None:
    acc.tokens += more.tokens
    acc.token_logprobs += more.token_logprobs
    acc.text_offset += more.text_offset
    acc.top_logprobs = (acc.top_logprobs or []) + (more.top_logprobs or [])


def chat_logprobs(lps: Sequence[TokenLogprob], text: TokenText) -> list[ChatTokenLogprob]:
    def one(t: int, v: float) -> TopLogprob:
        s = text(t)
        return TopLogprob(token=s, logprob=v, bytes=list(s.encode("utf-8")))

    return [ChatTokenLogprob(**one(lp.token_id, lp.logprob).model_dump(),
                             top_logprobs=[one(t, v) for t, v in lp.top]) for lp in lps]

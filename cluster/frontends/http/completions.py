"""POST /v1/completions: prompt (string, strings, token ids, lists of token ids) -> choices.

A list of prompts runs as one request per prompt (each admitted, routed and
counted on its own) and the choices are numbered prompt_index * n + i, as
OpenAI does. Defaults follow OpenAI: max_tokens 16, temperature 1.
"""
from __future__ import annotations

import contextlib
import time
import uuid
from collections import defaultdict
from typing import AsyncIterator

from cluster.frontends.http.convert import (TokenText, UsageTally, bad, completion_logprobs, extend_completion_logprobs,
                                  merged, renames, sampling_input)
from cluster.frontends.http.errors import to_openai_error
from cluster.frontends.http.openai_schema import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from cluster.frontends.http.sse import DONE, GenerationResponse, sse_event
from cluster.frontends.http.state import EndpointState
from cluster.frontends.validation import GenerateInput

DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 256


def prompt_inputs(req: CompletionRequest) -> list[dict]:
    """The prompt field -> one GenerateInput keyword set per prompt."""
    p = req.prompt
    if isinstance(p, str):
        return [{"prompt": p}]
    if not p:
        raise bad("prompt", "must not be an empty list; send a string, strings or token ids")
    if len(p) > MAX_PROMPTS:
        raise bad("prompt", f"{len(p)} prompts in one request; send at most {MAX_PROMPTS}")
    if isinstance(p[0], int):
        return [{"prompt_token_ids": tuple(p)}]
    if isinstance(p[0], str):
        return [{"prompt": s} for s in p]
    return [{"prompt_token_ids": tuple(ids)} for ids in p]


def check_supported(req: CompletionRequest) -> None:
    if req.echo:
        raise bad("echo", "not supported by pdserve; remove it or set it to false")
    if req.suffix:
        raise bad("suffix", "not supported by pdserve; remove it")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad("best_of", "not supported by pdserve (only best_of == n); use n")


def create_completion(req: CompletionRequest, state: EndpointState, cache_salt: str | None) -> GenerationResponse:
    check_supported(req)
    prompts = prompt_inputs(req)
    sampling = sampling_input(req, logprobs=req.logprobs, default_max_tokens=DEFAULT_MAX_TOKENS)
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = [state.runner.run(GenerateInput(request_id=f"{rid}-{i}", sampling=sampling,
                                              add_special_tokens=req.add_special_tokens, **kw),
                                cache_salt=cache_salt) for i, kw in enumerate(prompts)]
    shape = _Shape(rid, int(time.time()), state.model_name, req.n or 1, len(prompts),
                   TokenText(state.runner.backend.tokenizer(), req.return_tokens_as_token_ids)
                   if req.logprobs is not None else None)
    opts = req.stream_options
    body = (shape.stream(merged(streams), bool(opts and opts.include_usage),
                         bool(opts and opts.continuous_usage_stats)) if req.stream
            else shape.collect(merged(streams)))
    names = renames(req)
    return GenerationResponse(body, streaming=req.stream, to_error=lambda e: to_openai_error(e, names),
                              tracker=state.runner.track(), write_timeout=state.write_timeout)


class _Shape:
    def __init__(self, rid: str, created: int, model: str, n: int, num_prompts: int, text: TokenText | None):
        self.rid, self.created, self.model, self.n, self.num_prompts = rid, created, model, n, num_prompts
        self.text = text

    def _response(self, choices, usage=None) -> CompletionResponse:
        return CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices,
                                  usage=usage)

    async def stream(self, events, include_usage: bool, continuous: bool) -> AsyncIterator[bytes]:
        tally = UsageTally(self.num_prompts)
        offsets: dict[int, int] = {}
        async with contextlib.aclosing(events):
            async for p, c in events:
                tally.add(p, c)
                if not (c.text or c.finish_reason or c.token_ids):
                    continue
                idx = p * self.n + c.index
                lp = None
                if self.text is not None:
                    lp = completion_logprobs(c.logprobs, self.text, offsets.get(idx, 0))
                    offsets[idx] = offsets.get(idx, 0) + sum(len(t) for t in lp.tokens)
                choice = CompletionChoice(index=idx, text=c.text, logprobs=lp, finish_reason=c.finish_reason,
                                          stop_reason=c.stop_reason if c.finish_reason else None)
                yield sse_event(self._response([choice], tally.usage() if continuous else None).model_dump_json())
        if include_usage:
            yield sse_event(self._response([], tally.usage()).model_dump_json())
        yield DONE

    async def collect(self, events) -> AsyncIterator[bytes]:
        tally = UsageTally(self.num_prompts)
        total = self.num_prompts * self.n
        texts: dict[int, list[str]] = defaultdict(list)       # dicts: n is validated by the runner
        finish: dict[int, str | None] = {}
        stop: dict[int, int | str | None] = {}
        lps: dict[int, CompletionLogprobs] = defaultdict(lambda: CompletionLogprobs(top_logprobs=[]))
        async with contextlib.aclosing(events):
            async for p, c in events:
                tally.add(p, c)
                idx = p * self.n + c.index
                texts[idx].append(c.text)
                if self.text is not None and c.logprobs:
                    done = sum(len(t) for t in lps[idx].tokens)
                    extend_completion_logprobs(lps[idx], completion_logprobs(c.logprobs, self.text, done))
                if c.finish_reason:
                    finish[idx], stop[idx] = c.finish_reason, c.stop_reason
        choices = [CompletionChoice(index=i, text="".join(texts[i]), finish_reason=finish.get(i),
                                    stop_reason=stop.get(i),
                                    logprobs=lps[i] if self.text is not None else None) for i in range(total)]
        yield self._response(choices, tally.usage()).model_dump_json().encode("utf-8")

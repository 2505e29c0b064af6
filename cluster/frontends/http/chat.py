"""POST /v1/chat/completions: messages -> the model's chat template -> choices.

Text content only (a string, or a list of `{"type": "text"}` parts joined by
newlines). Defaults follow OpenAI: max_completion_tokens = what fits in the
context, temperature 1. Streaming sends `delta.role` with each choice's first
chunk and the content as it is decoded.
"""
from __future__ import annotations

import contextlib
import time
import uuid
from collections import defaultdict
from typing import AsyncIterator

from cluster.frontends.http.convert import TokenText, UsageTally, bad, chat_logprobs, merged, renames, sampling_input
from cluster.frontends.http.errors import to_openai_error
from cluster.frontends.http.openai_schema import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                        ChatCompletionResponse, ChatLogprobs, ChatMessageIn, ChatMessageOut,
                                        DeltaMessage)
from cluster.frontends.http.sse import DONE, GenerationResponse, sse_event
from cluster.frontends.http.state import EndpointState
from cluster.frontends.validation import ChatMessage, GenerateInput


def message_text(i: int, m: ChatMessageIn) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for j, part in enumerate(m.content):
        if part.type != "text":
            raise bad(f"messages[{i}].content[{j}].type", f"{part.type!r} parts are not supported; send text")
        parts.append(part.text or "")
    return "\n".join(parts)


def check_supported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise bad("tools", "tool calling is not supported by pdserve; remove tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad("response_format", "only {\"type\": \"text\"} is supported")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs", "needs logprobs: true")


def create_chat_completion(req: ChatCompletionRequest, state: EndpointState,
                           cache_salt: str | None) -> GenerationResponse:
    check_supported(req)
    messages = tuple(ChatMessage(m.role, message_text(i, m)) for i, m in enumerate(req.messages))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    sampling = sampling_input(req, logprobs=logprobs, default_max_tokens=None)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = state.runner.run(GenerateInput(request_id=rid, messages=messages, sampling=sampling,
                                            add_special_tokens=req.add_special_tokens),
                              cache_salt=cache_salt)
    shape = _Shape(rid, int(time.time()), state.model_name, req.n or 1,
                   TokenText(state.runner.backend.tokenizer(), req.return_tokens_as_token_ids)
                   if req.logprobs else None)
    opts = req.stream_options
    body = (shape.stream(merged([stream]), bool(opts and opts.include_usage),
                         bool(opts and opts.continuous_usage_stats)) if req.stream
            else shape.collect(merged([stream])))
    names = renames(req, logprobs_field="top_logprobs")
    return GenerationResponse(body, streaming=req.stream, to_error=lambda e: to_openai_error(e, names),
                              tracker=state.runner.track(), write_timeout=state.write_timeout)


class _Shape:
    def __init__(self, rid: str, created: int, model: str, n: int, text: TokenText | None) -> None:
        self.rid, self.created, self.model, self.n, self.text = rid, created, model, n, text

    def _logprobs(self, c) -> ChatLogprobs | None:
        return None if self.text is None else ChatLogprobs(content=chat_logprobs(c.logprobs, self.text))

    async def stream(self, events, include_usage: bool, continuous: bool) -> AsyncIterator[bytes]:
        tally = UsageTally(1)
        started: set[int] = set()
        async with contextlib.aclosing(events):
            async for _, c in events:
                tally.add(0, c)
                if not (c.text or c.finish_reason or c.token_ids):
                    continue
                role = None if c.index in started else "assistant"
                started.add(c.index)
                choice = ChatChunkChoice(index=c.index, delta=DeltaMessage(role=role, content=c.text),
                                         logprobs=self._logprobs(c), finish_reason=c.finish_reason,
                                         stop_reason=c.stop_reason if c.finish_reason else None)
                chunk = ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[choice],
                                            usage=tally.usage() if continuous else None)
                yield sse_event(chunk.model_dump_json())
        if include_usage:
            chunk = ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[],
                                        usage=tally.usage())
            yield sse_event(chunk.model_dump_json())
        yield DONE

    async def collect(self, events) -> AsyncIterator[bytes]:
        tally = UsageTally(1)
        texts: dict[int, list[str]] = defaultdict(list)       # dicts: n is validated by the runner
        finish: dict[int, str | None] = {}
        stop: dict[int, int | str | None] = {}
        lps: dict[int, list] = defaultdict(list)
        async with contextlib.aclosing(events):
            async for _, c in events:
                tally.add(0, c)
                texts[c.index].append(c.text)
                if self.text is not None:
                    lps[c.index] += chat_logprobs(c.logprobs, self.text)
                if c.finish_reason:
                    finish[c.index], stop[c.index] = c.finish_reason, c.stop_reason
        choices = [ChatChoice(index=i, message=ChatMessageOut(content="".join(texts[i])),
                              finish_reason=finish.get(i), stop_reason=stop.get(i),
                              logprobs=ChatLogprobs(content=lps[i]) if self.text is not None else None)
                   for i in range(self.n)]
        resp = ChatCompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices,
                                      usage=tally.usage())
        yield resp.model_dump_json().encode("utf-8")

"""Concurrent gRPC load for the chaos suite, and its greedy references.

Every request is greedy with ignore_eos, so its full output is known in
advance: `references()` runs transformers on the same prompts (batched by
prompt length) and a request's tokens must equal its reference exactly,
whatever happened to the workers on the way.
"""
from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc
import torch

from cluster.client import GenerationClient, build_request

VOCAB_LO, VOCAB_HI = 3, 380          # token ids of the tiny model's vocabulary, no specials


@dataclass(frozen=True)
class Req:
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    salt: str = ""


@dataclass
class Outcome:
    rid: str
    code: str = ""                    # "" = finished; else the grpc status name
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    refusals: int = 0                 # RESOURCE_EXHAUSTED answers before this outcome
    hints_ms: list[int] = field(default_factory=list)   # retry-after-ms of each refusal
    details: str = ""

    @property
    def finished(self) -> bool:
        return not self.code and bool(self.finish_reason)


def make_requests(rng: random.Random, n: int, tag: str, *, max_tokens: int, lengths=(24, 40),
                  salts=("",)) -> list[Req]:
    """`n` requests with fresh random prompts (no prefix shared by accident)."""
    return [Req(f"{tag}-{i}", tuple(rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.choice(lengths))),
                max_tokens, rng.choice(salts)) for i in range(n)]


def references(model, reqs: list[Req]) -> dict[str, list[int]]:
    """Greedy continuation of every prompt (transformers, batched per prompt length)."""
    by_len: dict[int, list[Req]] = defaultdict(list)
    for r in reqs:
        by_len[len(r.prompt)].append(r)
    out: dict[str, list[int]] = {}
    with torch.no_grad():
        for group in by_len.values():
            n = max(r.max_tokens for r in group)
            ids, past, toks = torch.tensor([r.prompt for r in group]), None, [[] for _ in group]
            for _ in range(n):
                res = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                nxt = res.logits[:, -1].argmax(-1)
                for t, v in zip(toks, nxt.tolist()):
                    t.append(v)
                ids = nxt[:, None]
            for r, t in zip(group, toks):
                out[r.rid] = t[:r.max_tokens]
    return out


OnChunk = Callable[[Req, int], Awaitable[bool] | bool | None]   # (request, tokens so far) -> stop early?


class TokenCount:
    """An on_chunk that counts the tokens streamed so far over every request (a
    chunk may carry several tokens when the frontend falls behind)."""

    def __init__(self) -> None:
        self._per_request: dict[str, int] = {}
        self.total = 0

    def __call__(self, req: Req, n: int) -> None:
        self.total += n - self._per_request.get(req.rid, 0)
        self._per_request[req.rid] = n


async def stream_one(client: GenerationClient, req: Req, *, timeout: float, on_chunk: OnChunk | None = None,
                     retries: int = 0, out: Outcome | None = None) -> Outcome:
    """One request to a terminal state. RESOURCE_EXHAUSTED is retried after its
    retry-after-ms hint up to `retries` times. on_chunk returning True cancels."""
    out = out or Outcome(req.rid)
    while True:
        request = build_request(prompt_token_ids=list(req.prompt), request_id=req.rid, cache_salt=req.salt,
                                max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        try:
            async for r in client.generate(request, timeout=timeout):
                out.tokens.extend(r.token_ids)
                if r.finish_reason:
                    out.finish_reason = r.finish_reason
                if on_chunk is not None:
                    stop = on_chunk(req, len(out.tokens))
                    if asyncio.iscoroutine(stop):
                        stop = await stop
                    if stop:
                        out.code = "CANCELLED_BY_CLIENT"
                        return out
            return out
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            if code == "RESOURCE_EXHAUSTED" and not out.tokens:
                hint = dict(e.trailing_metadata() or ()).get("retry-after-ms")
                out.refusals += 1
                out.hints_ms.append(int(hint) if hint else -1)
                if out.refusals <= retries and hint:
                    await asyncio.sleep(int(hint) / 1000)
                    continue
            out.code, out.details = code, e.details() or ""
            return out


async def run_load(target: str, reqs: list[Req], *, timeout: float = 240.0, channels: int = 8,
                   on_chunk: OnChunk | None = None, retries: int = 0,
                   during: Callable[[], Awaitable[None]] | None = None,
                   fault_grace_s: float = 60.0) -> dict[str, Outcome]:
    """All requests at once over `channels` connections; `during()` runs alongside (the fault)."""
    clients = [GenerationClient(target) for _ in range(channels)]
    try:
        tasks = [asyncio.create_task(stream_one(clients[i % channels], r, timeout=timeout, on_chunk=on_chunk,
                                                retries=retries)) for i, r in enumerate(reqs)]
        fault = asyncio.create_task(during()) if during else None
        outs = await asyncio.gather(*tasks)
        if fault is not None:
            # a fault that began its action finishes it (a drain waits for the worker's last
            # requests, which may be the load's last ones too); one still waiting for its moment
            # after `fault_grace_s` never fired, and the test sees that
            done, _ = await asyncio.wait({fault}, timeout=fault_grace_s)
            if not done:
                fault.cancel()
            await asyncio.gather(fault, return_exceptions=True)
        return {o.rid: o for o in outs}
    finally:
        for c in clients:
            await c.close()

"""`pdserve bench --backend openai|openai-chat`: drive any OpenAI-compatible server.

Each request is one streaming POST to /v1/completions (token-id prompts are
sent as token ids, text as text) or /v1/chat/completions (one user message;
token-id prompts are decoded to text with the tokenizer first), with
`stream_options.include_usage` so the token counts are the server's own
(`usage.completion_tokens`, `usage.prompt_tokens`,
`usage.prompt_tokens_details.cached_tokens`). Times are taken per SSE chunk
that carries text, as `vllm bench serve` does: TTFT at the first, one
inter-token gap per later chunk; TPOT from the usage count. `ignore_eos` (a
vLLM and pdserve extension) keeps every request to its output length; a
request's cache salt rides in `user` (pdserve salts its prefix cache by it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Sequence

import httpx

from cluster.tools.bench.datasets import BenchRequest
from cluster.tools.bench.runner import RequestResult, RunnerConfig

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class OpenAiTarget:
    base_url: str                    # http(s)://host:port, without /v1
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    verify: str | bool = True        # a CA bundle path for a private certificate

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if self.endpoint not in ENDPOINTS.values():
            raise ValueError(f"--endpoint must be one of {sorted(ENDPOINTS.values())}, got {self.endpoint!r}")

    @property
    def chat(self) -> bool:
        return self.endpoint == ENDPOINTS["openai-chat"]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class OpenAiModel:
    """What GET /v1/models says about the served model (max_model_len: vLLM's and pdserve's extension)."""
    name: str
    max_model_len: int | None


async def list_model(base_url: str, api_key: str | None, model: str | None, timeout: float,
                     verify: str | bool = True) -> OpenAiModel:
    """The served model named `model` (default: the first listed), from GET /v1/models."""
    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout, verify=verify) as c:
            r = await c.get(url, headers=headers)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach an OpenAI-compatible server at --base-url {base_url} "
                         f"({type(e).__name__}: {e}); is it running there?") from None
    if r.status_code != 200:
        raise ValueError(f"GET {url} answered {r.status_code}: {r.text[:200]} (a wrong --api-key?)")
    cards = r.json().get("data") or []
    if not cards:
        raise ValueError(f"GET {url} lists no model")
    if model is not None:
        found = [c for c in cards if c.get("id") == model]
        if not found:
            raise ValueError(f"--model {model!r} is not served at {base_url}; it serves "
                             f"{[c.get('id') for c in cards]}")
        cards = found
    card = cards[0]
    return OpenAiModel(card["id"], card.get("max_model_len"))


class OpenAiSender:
    """Sends BenchRequests as streaming OpenAI requests over one pooled HTTP client."""

    def __init__(self, target: OpenAiTarget, cfg: RunnerConfig,
                 decode: Callable[[Sequence[int]], str] | None = None) -> None:
        self.target = target
        self.cfg = cfg
        self.decode = decode
        self._client = httpx.AsyncClient(base_url=target.base_url.rstrip("/"), verify=target.verify,
                                         timeout=httpx.Timeout(None, connect=30.0),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def body(self, req: BenchRequest, request_id: str) -> dict:
        out: dict = {"model": self.target.model, "stream": True, "stream_options": {"include_usage": True},
                     "temperature": self.cfg.temperature, "ignore_eos": self.cfg.ignore_eos}
        if req.cache_salt:
            out["user"] = req.cache_salt
        if self.target.chat:
            out["messages"] = [{"role": "user", "content": self._text(req)}]
            out["max_completion_tokens"] = req.output_len
        else:
            out["prompt"] = req.prompt if req.prompt is not None else list(req.prompt_token_ids)
            out["max_tokens"] = req.output_len
        return out

    def _text(self, req: BenchRequest) -> str:
        if req.prompt is not None:
            return req.prompt
        if self.decode is None:
            raise ValueError("chat requests need text: give a --tokenizer to decode token-id prompts")
        return self.decode(req.prompt_token_ids)

    async def send(self, req: BenchRequest, request_id: str, res: RequestResult, loop, start: float) -> None:
        sent = loop.time()
        last: float | None = None
        chunks = 0
        try:
            async with self._client.stream("POST", self.target.endpoint, json=self.body(req, request_id),
                                           headers={**self.target.headers, "X-Request-Id": request_id}) as r:
                if r.status_code != 200:
                    res.error_code = f"HTTP_{r.status_code}"
                    res.error = (await r.aread()).decode("utf-8", "replace")[:500]
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        res.error_code, res.error = "STREAM_ERROR", json.dumps(event["error"])[:500]
                        return
                    now = loop.time()
                    if self._content(event):
                        if last is None:
                            res.ttft_s = now - sent
                        else:
                            res.itl_s.append(now - last)
                        res.token_times_s.append(now - start)
                        chunks += 1
                        last = now
                    if event.get("usage"):
                        self._usage(event["usage"], res)
            if res.ttft_s is None:
                res.error_code, res.error = "NO_OUTPUT", "the stream ended without any text"
                return
            if not res.output_tokens:   # a server without usage in its stream: one token per chunk
                res.output_tokens = chunks
            res.e2e_s = loop.time() - sent
        except (httpx.HTTPError, OSError, ValueError) as e:
            res.error_code, res.error = "CLIENT_ERROR", f"{type(e).__name__}: {e}"

    def _content(self, event: dict) -> bool:
        choices = event.get("choices") or []
        if not choices:
            return False
        c = choices[0]
        return bool((c.get("delta") or {}).get("content") if self.target.chat else c.get("text"))

    @staticmethod
    def _usage(u: dict, res: RequestResult) -> None:
        res.prompt_tokens = u.get("prompt_tokens") or res.prompt_tokens
        res.output_tokens = u.get("completion_tokens") or res.output_tokens
        res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    async def close(self) -> None:
        await self._client.aclose()

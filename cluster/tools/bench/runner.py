"""The open-loop sender: requests go out on their schedule, whatever the server's state.

An optional cap on concurrency holds a due request until a slot frees; that
wait is recorded apart (`cap_wait_s`) and is not part of its TTFT or
end-to-end latency, which run from the moment the RPC starts. The run is
bounded by the number of requests and, optionally, by a duration after which
nothing new is sent. Requests still running when none has finished for
`drain_timeout_s` (or `drain_timeout_s` after the duration) are cancelled and
reported as INCOMPLETE.

Requests go out through a `Sender`: `GrpcSender` (pdserve's gRPC API, the
default for a `host:port` target) or `OpenAiSender` (cluster/tools/bench/openai_sender.py,
any OpenAI-compatible HTTP server).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol, Sequence

import grpc

from cluster.tools.bench.datasets import BenchRequest
from cluster.cli.client import GenerationClient, build_request

INCOMPLETE = "INCOMPLETE"        # cut off by the drain timeout (not a server failure)


@dataclass(frozen=True)
class RunnerConfig:
    max_concurrency: int = 0         # 0 = no cap
    duration_s: float = 0.0          # 0 = until every request is sent
    drain_timeout_s: float = 120.0
    temperature: float = 0.0
    ignore_eos: bool = True
    channels: int = 4                # gRPC connections the requests are spread over
    progress: bool = True
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency < 0:
            raise ValueError(f"--max-concurrency must be >= 1 (or 0 for no cap), got {self.max_concurrency}")
        if self.duration_s < 0 or self.drain_timeout_s < 0:
            raise ValueError("--duration and --drain-timeout must be >= 0 seconds")
        if self.channels < 1:
            raise ValueError(f"channels must be >= 1, got {self.channels}")


@dataclass
class RequestResult:
    index: int
    scheduled_s: float               # planned send time, from the start of the run
    sent_s: float = 0.0              # when the RPC started (after any wait on the cap)
    cap_wait_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)       # every inter-token gap
    token_times_s: list[float] = field(default_factory=list)   # each token's arrival, from the start
    e2e_s: float | None = None
    error_code: str = ""             # "" = finished; else the gRPC status name (or INCOMPLETE)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error_code

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.e2e_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class RunResult:
    results: list[RequestResult]
    elapsed_s: float                 # first send -> last response
    not_sent: int = 0                # scheduled after --duration


class Sender(Protocol):
    """Sends one request and fills in its result (times, token counts, or an error code)."""
    async def send(self, req: BenchRequest, request_id: str, res: RequestResult, loop, start: float) -> None: ...
    async def close(self) -> None: ...


class GrpcSender:
    """pdserve's gRPC Generate stream, the requests spread over cfg.channels connections."""

    def __init__(self, target: str, cfg: RunnerConfig) -> None:
        opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20)]
        self.cfg = cfg
        self._clients = [GenerationClient(target, api_key=cfg.api_key, options=opts) for _ in range(cfg.channels)]
        self._next = 0

    async def send(self, req: BenchRequest, request_id: str, res: RequestResult, loop, start: float) -> None:
        self._next += 1
        await _send(self._clients[self._next % len(self._clients)], _request(req, self.cfg, request_id), res,
                    loop, start)

    async def close(self) -> None:
        for c in self._clients:
            await c.close()


async def run_load(target: str | Sender, requests: Sequence[BenchRequest], offsets: Sequence[float],
                   cfg: RunnerConfig, *, tag: str | None = None) -> RunResult:
    """Send `requests` at `offsets` seconds from the start; `target` is a gRPC host:port or a Sender."""
    if len(offsets) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(offsets)} send times")
    tag = tag or os.urandom(4).hex()
    sender = GrpcSender(target, cfg) if isinstance(target, str) else target
    loop = asyncio.get_running_loop()
    cap = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = _progress(len(requests), cfg.progress)
    results: list[RequestResult] = []
    start = loop.time()
    last_end = [start]

    async def one(i: int, req: BenchRequest, offset: float) -> None:
        res = RequestResult(i, offset, prompt_tokens=req.prompt_len)
        due = loop.time()
        async with (cap or contextlib.nullcontext()):
            now = loop.time()
            if cfg.duration_s and now - start >= cfg.duration_s:
                return   # its slot came after the end of the run: never sent
            res.cap_wait_s, res.sent_s = now - due, now - start
            results.append(res)
            try:
                await sender.send(req, f"bench-{tag}-{i}", res, loop, start)
            except asyncio.CancelledError:
                res.error_code, res.error = INCOMPLETE, "still running at the drain timeout"
                raise
            finally:
                last_end[0] = max(last_end[0], loop.time())
                bar.update(1)

    try:
        tasks, not_sent = await _start_on_schedule(requests, offsets, cfg, one, loop, start)
        pending = await _drain(set(tasks), cfg, loop, start)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        bar.close()
        await sender.close()
    results.sort(key=lambda r: r.index)
    not_sent += len(tasks) - len(results)
    return RunResult(results, max(0.0, last_end[0] - start), not_sent)


async def _start_on_schedule(requests: Sequence[BenchRequest], offsets: Sequence[float], cfg: RunnerConfig,
                             one: Callable[[int, BenchRequest, float], Awaitable[None]], loop,
                             start: float) -> tuple[list[asyncio.Task], int]:
    """Start ``one(i, request, offset)`` at each offset from ``start`` until the run's
    duration ends. Returns the started tasks and how many requests were never started."""
    tasks: list[asyncio.Task] = []
    for i, (req, off) in enumerate(zip(requests, offsets)):
        if cfg.duration_s and off >= cfg.duration_s:
            return tasks, len(requests) - i
        delay = start + off - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, req, off)))
    return tasks, 0


async def _drain(pending: set, cfg: RunnerConfig, loop, start: float) -> set:
    """Wait for the sent requests; give up when none finishes for drain_timeout_s or, with a
    duration, drain_timeout_s after it ends. Returns what is still running."""
    end = start + cfg.duration_s + cfg.drain_timeout_s if cfg.duration_s else float("inf")
    while pending:
        timeout = min(cfg.drain_timeout_s, end - loop.time())
        done, pending = await asyncio.wait(pending, timeout=max(0.0, timeout),
                                           return_when=asyncio.FIRST_COMPLETED)
        if not done:
            break
    return pending


def _request(req: BenchRequest, cfg: RunnerConfig, request_id: str):
    return build_request(prompt=req.prompt, prompt_token_ids=req.prompt_token_ids, request_id=request_id,
                         cache_salt=req.cache_salt, max_tokens=req.output_len, temperature=cfg.temperature,
                         ignore_eos=cfg.ignore_eos or None)


async def _send(client: GenerationClient, request, res: RequestResult, loop, start: float) -> None:
    sent = loop.time()
    last: float | None = None
    try:
        async for chunk in client.generate(request):
            now = loop.time()
            k = len(chunk.token_ids)
            if k:
                if last is None:
                    res.ttft_s = now - sent
                else:   # a chunk of k tokens: k gaps, evenly split
                    res.itl_s.extend([(now - last) / k] * k)
                res.token_times_s.extend([now - start] * k)
                res.output_tokens += k
                last = now
            if chunk.finish_reason:
                u = chunk.usage
                res.prompt_tokens = u.prompt_tokens or res.prompt_tokens
                res.output_tokens = u.completion_tokens or res.output_tokens
                res.cached_tokens = u.cached_tokens
        res.e2e_s = loop.time() - sent
    except grpc.aio.AioRpcError as e:
        res.error_code, res.error = e.code().name, e.details() or ""
    except (OSError, RuntimeError, ValueError) as e:
        res.error_code, res.error = "CLIENT_ERROR", f"{type(e).__name__}: {e}"


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True, leave=False)

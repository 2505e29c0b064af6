"""A real gRPC frontend over a real LocalEngineBackend, on its own event-loop thread.

Tests talk to it with `cluster.cli.client.GenerationClient` from their own thread
(`asyncio.run`), exactly as a remote client would.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field

from cluster.config import ServeConfig
from cluster.frontends.grpc.server import GrpcServer, serve_grpc
from cluster.frontends.runner import RequestRunner
from cluster.orchestration.local import LocalEngineBackend
from cluster.observability.metrics import Metrics
from cluster.observability.metrics_server import MetricsServer, start_metrics_server
from cluster.observability.task_trace import describe_task
from engine.config import CacheConfig, EngineConfig, SchedulerConfig


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now, for a server config: in `pdserve serve` (start_stack) port 0 turns a
    frontend off, so a test stack that wants gRPC (or HTTP) on any port picks one here."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def held_port(host: str = "127.0.0.1"):
    """A TCP port for a server that binds it later, after slow work (another process starting
    up, a transfer agent loading), held meanwhile: bound here, not listening, with SO_REUSEADDR
    (and SO_REUSEPORT). The kernel hands no bound port out (bind to port 0, or a connect), while
    the server's own bind beside it succeeds: on Linux sockets that all set SO_REUSEADDR may
    share a port while at most one of them listens (pdserve's port claims, its gRPC and HTTP
    endpoints and the KV side channel all set it; same user). A port from `free_port` is free
    again the moment it returns: a process started meanwhile (Ray's, a UCX listener) can be
    handed it first."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, 0))
        yield s.getsockname()[1]


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="frontend-loop")
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float = 120.0):
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Frontend:
    loop: LoopThread
    backend: LocalEngineBackend
    metrics: Metrics
    server: GrpcServer
    metrics_server: MetricsServer
    extra: list = field(default_factory=list)
    give_ups: _GiveUps | None = None

    @property
    def target(self) -> str:
        return self.server.target

    def serve_another(self, **kwargs) -> GrpcServer:
        """A second endpoint on the same backend (e.g. with API keys or TLS), with its own runner."""
        cfg = ServeConfig(grpc_port=0)
        srv = self.loop.run(serve_grpc(RequestRunner.from_config(self.backend, cfg, Metrics()), cfg, **kwargs))
        self.extra.append(srv)
        return srv

    def engine(self, fn):
        """fn(engine) on the engine thread."""
        return self.loop.run(self.backend.call(fn))

    def kv_used(self) -> int:
        return self.engine(lambda e: e.stats().kv_blocks_used)

    def wait_idle(self, baseline: int, timeout: float = 60.0) -> None:
        """Until nothing runs or waits, KV usage is back at `baseline` and the frontend holds no
        admission ticket; then check the engine's integrity."""
        end = time.monotonic() + timeout
        while True:
            s = self.engine(lambda e: e.stats())
            queued = self.sample("pdserve_frontend_queue_depth")
            if s.running == 0 and s.waiting == 0 and s.kv_blocks_used == baseline and queued == 0:
                break
            assert time.monotonic() < end, (f"not idle: {s}, baseline {baseline}, frontend queue {queued}, "
                                            f"generated {self.sample('pdserve_generation_tokens_total')}; "
                                            f"tasks on the frontend loop:\n{self.task_stacks()}")
            time.sleep(0.05)
        self.engine(lambda e: e.check_integrity())

    def task_stacks(self) -> str:
        """Each task on the frontend loop and the chain of awaits it waits in (for a failure message)."""
        async def dump() -> str:
            out = []
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    out.append(describe_task(t))
            return "\n".join(out) or "(none)"
        return self.loop.run(dump(), timeout=30)

    def sample(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    @contextlib.contextmanager
    def stalled_engine(self):
        """Hold the engine thread between steps: nothing progresses until the block exits."""
        started, release = threading.Event(), threading.Event()
        fut = self.loop.submit(self.backend.call(lambda e: (started.set(), release.wait(120))))
        assert started.wait(60), "the engine thread did not pick up the stall command"
        try:
            yield
        finally:
            release.set()
            fut.result(60)

    def close(self) -> None:
        if self.give_ups is not None:   # shown in pytest's warnings summary even when every test passed
            logging.getLogger("cluster.frontends.runner").removeHandler(self.give_ups)
            for message in self.give_ups.messages:
                warnings.warn(f"frontend runner gave up on a stream: {message}", stacklevel=2)
        for srv in [self.server, *self.extra]:
            self.loop.run(srv.stop(0))
        self.metrics_server.stop()
        self.loop.run(self.backend.stop())
        self.loop.close()


def start_frontend(model_dir, *, max_model_len: int = 1024, num_blocks: int = 256, block_size: int = 16,
                   config: ServeConfig | None = None) -> Frontend:
    loop = LoopThread()
    engine_cfg = EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                              scheduler=SchedulerConfig(max_model_len=max_model_len))
    metrics = Metrics()

    async def up():
        backend = LocalEngineBackend(engine_cfg)
        await backend.start()
        cfg = config or ServeConfig(grpc_port=0)     # serve_grpc itself: port 0 = any free port
        server = await serve_grpc(RequestRunner.from_config(backend, cfg, metrics), cfg)
        return backend, server

    backend, server = loop.run(up())
    ms = start_metrics_server(metrics, "127.0.0.1", 0)
    give_ups = _GiveUps()
    logging.getLogger("cluster.frontends.runner").addHandler(give_ups)
    return Frontend(loop, backend, metrics, server, ms, give_ups=give_ups)


class _GiveUps(logging.Handler):
    """The runner's "stream was not read" warnings: each is a consumer that stopped taking
    output without being cancelled (where it waited is in the message)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "was not read" in message:
            self.messages.append(message)


@contextlib.contextmanager
def http_frontend(model_dir, **frontend_kwargs):
    """start_frontend plus the OpenAI HTTP endpoint on the same request runner (`f.http`)."""
    from cluster.frontends.http import serve_http

    f = start_frontend(model_dir, **frontend_kwargs)
    try:
        f.http = f.loop.run(serve_http(f.server.runner, ServeConfig(http_port=0)))
        yield f
        f.loop.run(f.http.stop(5))
    finally:
        f.close()


def http_greedy_tokens(url: str, ids: list[int], max_tokens: int) -> list[int]:
    """A greedy /v1/completions call (ignore_eos): the completion's token ids."""
    import json
    import urllib.request

    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    return [int(t.removeprefix("token_id:")) for t in out["choices"][0]["logprobs"]["tokens"]]

"""Everything `pdserve serve` runs in its process: backend, request runner, gRPC and/or HTTP
(OpenAI), metrics.

The stack owns the one `RequestRunner` (admission, deadline, metrics, in-flight tracking)
and hands it to each frontend it starts; either frontend runs without the other
(`grpc_port: 0` / `http_port: 0` turn one off; not both).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.config import ServeConfig
from cluster.frontends.runner import RequestRunner
from cluster.observability.metrics import Metrics
from cluster.orchestration.backend import GenerationBackend

if TYPE_CHECKING:
    from cluster.frontends.ports import PortClaims
    from cluster.frontends.grpc.server import GrpcServer
    from cluster.frontends.http import HttpServer
    from cluster.observability.metrics_server import MetricsServer

log = logging.getLogger(__name__)


@dataclass
class ServerStack:
    config: ServeConfig
    metrics: Metrics
    backend: GenerationBackend
    runner: RequestRunner               # the one runner both frontends serve through
    grpc: "GrpcServer | None"           # None when grpc_port == 0
    http: "HttpServer | None"           # None when http_port == 0
    metrics_server: "MetricsServer"

    def banner(self) -> str:
        info = self.backend.model_info()
        pools = ", ".join(f"{n} {k}" for k, n in sorted(info.pools.items()))
        lines = [f"pdserve: serving {info.model_name} ({pools}; max_model_len {info.max_model_len})"]
        if self.grpc is not None:
            lines.append(f"  gRPC     {self.grpc.target}   (pdserve.v1.Generation, grpc.health.v1, reflection)")
        if self.http is not None:
            lines.append(f"  HTTP     {self.http.url}   (OpenAI-compatible: /v1/completions, /v1/chat/completions)")
        lines.append(f"  metrics  {self.metrics_server.url}")
        tries = []
        if self.grpc is not None:
            t = self.grpc.target
            tries += [f"pdserve generate --target {t} --chat \"What is the capital of France?\"",
                      f"grpcurl -plaintext {t} list"]
        if self.http is not None:
            tries.append(f"curl -s {self.http.url}/v1/models")
        lines += [("  try:     " if i == 0 else "           ") + t for i, t in enumerate(tries)]
        return "\n".join(lines)

    async def drain_and_stop(self, timeout: float) -> None:
        """Readiness off on every frontend at once, the calls in flight given `timeout` seconds
        (the frontends wait on the one runner), then the listeners, metrics and the backend stop."""
        if self.http is not None:
            self.http.set_serving(False)     # GET /ready -> 503 at once, like gRPC health
        stops = [f.stop(grace=timeout) for f in (self.grpc, self.http) if f is not None]
        await asyncio.gather(*stops)
        self.metrics_server.stop()
        await self.backend.stop()


def check_frontends(cfg: ServeConfig) -> None:
    """At least one frontend: gRPC (grpc_port) or HTTP (http_port), on two ports; 0 turns one off.
    Metrics on a port of their own (0: any free port)."""
    if cfg.grpc_port == 0 and cfg.http_port == 0:
        raise ValueError("grpc_port and http_port are both 0, which turns both frontends off; set one "
                         "(--grpc-port 50051 for gRPC, --http-port 8000 for the OpenAI-compatible HTTP API)")
    if cfg.grpc_port == cfg.http_port:
        raise ValueError(f"grpc_port and http_port are both {cfg.grpc_port}: the two endpoints need two ports "
                         "(e.g. --grpc-port 50051 --http-port 8000)")
    for name in ("grpc_port", "http_port"):
        if cfg.metrics_port and cfg.metrics_port == getattr(cfg, name):
            raise ValueError(f"metrics_port and {name} are both {cfg.metrics_port}: metrics need a port of their "
                             "own (e.g. --metrics-port 9400, or 0 for any free port)")


def make_backend(cfg: ServeConfig, metrics: Metrics) -> GenerationBackend:
    if not cfg.ray:
        from cluster.orchestration.launcher import engine_config
        from cluster.orchestration.local import LocalEngineBackend
        return LocalEngineBackend(engine_config(cfg), model_name=cfg.served_model_name[0] if cfg.served_model_name
                                  else None)
    from cluster.orchestration.cluster_backend import ClusterBackend
    return ClusterBackend(cfg, metrics)


async def start_stack(cfg: ServeConfig, backend: GenerationBackend | None = None) -> ServerStack:
    """Start everything `pdserve serve` runs. The endpoints' ports are claimed first (a taken port
    fails here, before Ray and the weights; cluster/frontends/ports.py); a step that fails stops
    what the steps before it started (the backend's workers included) before the error propagates."""
    from cluster.frontends.ports import claim_ports

    check_frontends(cfg)
    claims = claim_ports(cfg.host, cfg.grpc_port, cfg.http_port, cfg.metrics_port)
    started: list = []     # what to stop, last first, if a later step fails
    try:
        return await _start(cfg, backend, claims, started)
    except BaseException:
        await _stop_started(started)
        raise
    finally:
        claims.release()


async def _start(cfg: ServeConfig, backend: GenerationBackend | None, claims: PortClaims,
                 started: list) -> ServerStack:
    from cluster.frontends.auth import ApiKeys, TlsConfig
    from cluster.observability.metrics_server import start_metrics_server
    from cluster.preflight import preflight

    cfg = preflight(cfg)     # certificates, keys, device, model: checked before Ray and the weights
    metrics = Metrics()
    backend = backend or make_backend(cfg, metrics)
    started.append(backend)
    await backend.start()
    info = backend.model_info()
    metrics.export_vllm_names(info.model_name, info.block_size)   # what inference gateways scrape
    keys = ApiKeys.from_file(cfg.api_keys_file) if cfg.api_keys_file else ApiKeys.from_env()
    tls = (TlsConfig(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file or None)
           if cfg.tls_cert_file else None)
    runner = RequestRunner.from_config(backend, cfg, metrics)
    grpc_server = http = None
    if cfg.grpc_port != 0:
        from cluster.frontends.grpc.server import serve_grpc
        grpc_server = await serve_grpc(runner, cfg, api_keys=keys, tls=tls, claim=claims)
        started.append(grpc_server)
    if cfg.http_port != 0:
        from cluster.frontends.http import serve_http
        http = await serve_http(runner, cfg, api_keys=keys, model_names=cfg.served_model_name, tls=tls,
                                sock=claims.take_http())
        started.append(http)
    claims.release_metrics()     # the server binds the port at once, in this thread
    msrv = start_metrics_server(metrics, cfg.host, cfg.metrics_port)
    return ServerStack(cfg, metrics, backend, runner, grpc_server, http, msrv)


async def _stop_started(started: list) -> None:
    """Stop what a failed start had started, last first; a stop that fails too is logged, not raised
    (the start's own error is the one to see)."""
    for part in reversed(started):
        try:
            if isinstance(part, GenerationBackend):
                await part.stop()
            else:
                await part.stop(grace=0)
        except Exception:
            log.exception("stopping %s after a failed start", type(part).__name__)

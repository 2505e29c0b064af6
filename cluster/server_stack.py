"""Everything `pdserve serve` runs in its process: backend, gRPC, HTTP (OpenAI), metrics."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from cluster.orchestration.backend import GenerationBackend
from cluster.config import ServeConfig
from cluster.observability.metrics import Metrics


@dataclass
class ServerStack:
    config: ServeConfig
    metrics: Metrics
    backend: GenerationBackend
    grpc: object
    metrics_server: object
    http: object = None            # cluster.frontends.http.HttpServer, None when http_port == 0

    def banner(self) -> str:
        info = self.backend.model_info()
        pools = ", ".join(f"{n} {k}" for k, n in sorted(info.pools.items()))
        t = self.grpc.target
        return (f"pdserve: serving {info.model_name} ({pools}; max_model_len {info.max_model_len})\n"
                f"  gRPC     {t}   (pdserve.v1.Generation, grpc.health.v1, reflection)\n"
                + (f"  HTTP     {self.http.url}   (OpenAI-compatible: /v1/completions, /v1/chat/completions)\n"
                   if self.http is not None else "")
                + f"  metrics  {self.metrics_server.url}\n"
                f"  try:     pdserve generate --target {t} --chat \"What is the capital of France?\"\n"
                f"           grpcurl -plaintext {t} list"
                + (f"\n           curl -s {self.http.url}/v1/models" if self.http is not None else ""))

    async def drain_and_stop(self, timeout: float) -> None:
        if self.http is not None:
            self.http.set_serving(False)     # GET /ready -> 503 at once, like gRPC health
        await asyncio.gather(self.grpc.stop(grace=timeout),
                             *([self.http.stop(grace=timeout)] if self.http is not None else []))
        self.metrics_server.stop()
        await self.backend.stop()


def make_backend(cfg: ServeConfig, metrics: Metrics) -> GenerationBackend:
    if not cfg.ray:
        from cluster.orchestration.launcher import engine_config
        from cluster.orchestration.local import LocalEngineBackend
        return LocalEngineBackend(engine_config(cfg), model_name=cfg.served_model_name[0] if cfg.served_model_name
                                  else None)
    from cluster.orchestration.cluster_backend import ClusterBackend
    return ClusterBackend(cfg, metrics)


async def start_stack(cfg: ServeConfig, backend: GenerationBackend | None = None) -> ServerStack:
    from cluster.frontends.auth import ApiKeys, TlsConfig
    from cluster.frontends.grpc.server import serve_grpc
    from cluster.observability.metrics_server import start_metrics_server
    from cluster.preflight import preflight

    cfg = preflight(cfg)     # certificates, keys, device, model: checked before Ray and the weights
    metrics = Metrics()
    backend = backend or make_backend(cfg, metrics)
    await backend.start()
    info = backend.model_info()
    metrics.export_vllm_names(info.model_name, info.block_size)   # what inference gateways scrape
    keys = ApiKeys.from_file(cfg.api_keys_file) if cfg.api_keys_file else ApiKeys.from_env()
    tls = (TlsConfig(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file or None)
           if cfg.tls_cert_file else None)
    if cfg.tls_cert_file and not cfg.tls_key_file:
        raise ValueError("tls_cert_file is set but tls_key_file is not: give both")
    grpc_server = await serve_grpc(backend, cfg, metrics, api_keys=keys, tls=tls)
    http = None
    if cfg.http_port != 0:
        from cluster.frontends.http import serve_http
        http = await serve_http(grpc_server.runner, cfg, metrics, api_keys=keys,   # shares admission
                                model_names=cfg.served_model_name, tls=tls)
    msrv = start_metrics_server(metrics, cfg.host, cfg.metrics_port)
    return ServerStack(cfg, metrics, backend, grpc_server, msrv, http)

"""The HTTP endpoint: uvicorn serving `create_app` on the caller's event loop.

    http = await serve_http(runner, config, api_keys=keys)   # config.host:config.http_port
    http.port; http.url; ...; http.set_serving(False); await http.stop(grace=30)

Port 0 binds any free port (tests); the bound port is returned. uvicorn does
not install signal handlers here (the serve process owns SIGTERM/SIGINT and
drains every endpoint itself). Every accepted connection gets TCP_NODELAY so
each SSE chunk leaves at once instead of waiting on Nagle's algorithm.
With `tls` (the gRPC port's certificate flags: tls_cert_file, tls_key_file,
tls_client_ca_file) the port speaks HTTPS only, mutual TLS when a client CA is
given, so API keys never cross the network in the clear.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from dataclasses import dataclass

import uvicorn

from cluster.config import ServeConfig
from cluster.frontends.auth import ApiKeys, TlsConfig
from cluster.frontends.http.app import create_app
from cluster.frontends.http.state import EndpointState
from cluster.frontends.ports import bind_http
from cluster.frontends.runner import RequestRunner

log = logging.getLogger(__name__)


def nodelay_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (httptools when installed, else h11) with TCP_NODELAY set."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:   # pragma: no cover - httptools is optional
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    class NoDelayProtocol(base):   # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(transport)

    return NoDelayProtocol


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):   # the serve process handles signals and drains us
        yield


def uvicorn_tls(tls: TlsConfig | None) -> dict:
    """uvicorn.Config's TLS settings from the server's TlsConfig (the gRPC port's files): one context,
    its files read (and checked) here."""
    if tls is None:
        return {}
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
        if tls.client_ca_file:
            ctx.load_verify_locations(tls.client_ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cannot use the TLS files for the HTTP endpoint (cert {tls.cert_file}, key "
                         f"{tls.key_file}, client CA {tls.client_ca_file or '-'}): {e}; give PEM files whose "
                         "key matches the certificate") from e
    return dict(ssl_context_factory=lambda config, default: ctx)


@dataclass
class HttpServer:
    host: str
    port: int
    state: EndpointState
    _server: uvicorn.Server
    _task: asyncio.Task
    tls: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    @property
    def serving(self) -> bool:
        return self.state.serving

    def set_serving(self, serving: bool) -> None:
        """Readiness: False = GET /ready 503 and new generation requests 503 (draining)."""
        self.state.serving = serving

    async def stop(self, grace: float | None = None) -> None:
        """Drain: refuse new requests (the listener stays up, so /ready answers 503), give the
        in-flight ones `grace` seconds, then close the connections and cancel what is left."""
        self.set_serving(False)
        runner = self.state.runner
        if not await runner.wait_idle(grace):
            log.warning("HTTP drain: %d calls still running after %s s; cancelling them", runner.in_flight, grace)
        self._server.config.timeout_graceful_shutdown = 1
        self._server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        await runner.wait_cleanups(timeout=grace)


async def serve_http(runner: RequestRunner, config: ServeConfig, *, api_keys: ApiKeys | None = None,
                     model_name: str | None = None, model_names: tuple[str, ...] = (),
                     tls: TlsConfig | None = None, sock: socket.socket | None = None) -> HttpServer:
    """Start the OpenAI-compatible endpoint on config.host:config.http_port (0 = any free port),
    or on `sock` when the caller bound it already (cluster/frontends/ports.py; the endpoint closes it)
    over `runner` (the process's one runner: admission, deadline, metrics and in-flight tracking
    shared with the gRPC endpoint when it runs); HTTPS with `tls`.
    `model_names`: the served names (aliases, the first listed); default: `model_name`, else the backend's."""
    sock = sock if sock is not None else bind_http(config.host, config.http_port)
    try:
        app = create_app(runner, model_names=model_names or ((model_name,) if model_name else ()),
                         api_keys=api_keys, write_timeout=config.stream_write_timeout)
        cfg = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, http=nodelay_protocol(),
                             timeout_keep_alive=30, ws="none", **uvicorn_tls(tls))
    except BaseException:
        sock.close()
        raise
    server = _Server(cfg)
    port = sock.getsockname()[1]
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            task.result()    # raises the startup error
            raise RuntimeError(f"the HTTP endpoint on {config.host}:{port} did not start")
        await asyncio.sleep(0.01)
    out = HttpServer(config.host, port, app.state.pdserve, server, task, tls=tls is not None)
    log.info("OpenAI-compatible HTTP endpoint on %s (api keys=%s, tls=%s)", out.url, api_keys is not None,
             "mutual" if tls and tls.mutual else tls is not None)
    return out

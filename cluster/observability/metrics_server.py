"""Serve one `Metrics` registry over HTTP for Prometheus (GET /metrics, any path).

    ms = start_metrics_server(metrics, "127.0.0.1", 9400)   # port 0 = any free port
    ms.port; ms.url; ms.stop()

prometheus_client's WSGI server in a daemon thread, bound to the given host
only, exporting the given registry only (never the process-global one).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server

from cluster.observability.metrics import Metrics


@dataclass
class MetricsServer:
    host: str
    port: int
    _httpd: object
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(metrics: Metrics | CollectorRegistry, host: str, port: int) -> MetricsServer:
    registry = metrics.registry if isinstance(metrics, Metrics) else metrics
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise RuntimeError(f"cannot serve metrics on {host}:{port} ({e}); pick a free --metrics-port") from e
    return MetricsServer(host, httpd.server_address[1], httpd, thread)

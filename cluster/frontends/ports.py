"""The endpoints' ports, claimed before the backend starts.

`pdserve serve` starts Ray and loads weights before its endpoints listen: seconds to
minutes, in which Ray's own processes open many sockets. A port named in the config
(`--grpc-port`, `--http-port`, `--metrics-port`) is claimed first, so a port already
taken fails the start at once, before Ray, and the kernel hands it to none of the
sockets opened meanwhile (binds to port 0, connects).

- HTTP: the endpoint's own socket, bound here and handed to `serve_http`.
- gRPC: the Python server binds its own socket and cannot adopt one. The claim is a
  bound socket (not listening) that `serve_grpc` closes just before its server binds
  the port, in the same thread, without SO_REUSEPORT: so a second server on the port
  is refused rather than sharing it (gRPC's default would let two bind it).
- metrics: prometheus_client's server binds its own socket too; the claim is a placeholder
  released just before it binds (`release_metrics`). A metrics port of 0 means any free
  port, picked as the server binds: nothing to claim.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass
class PortClaims:
    grpc: socket.socket | None = None   # the placeholder serve_grpc releases as it binds; None: gRPC off
    http: socket.socket | None = None   # the HTTP endpoint's socket; None: HTTP off (or handed over)
    metrics: socket.socket | None = None  # the placeholder released as the metrics server binds; None: port 0

    def take_http(self) -> socket.socket | None:
        """The HTTP socket, now the endpoint's to close."""
        sock, self.http = self.http, None
        return sock

    def release_grpc(self) -> None:
        if self.grpc is not None:
            self.grpc.close()
            self.grpc = None

    def release_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def release(self) -> None:
        """Everything still held (a start that failed before the endpoints took their ports)."""
        self.release_grpc()
        self.release_metrics()
        if self.http is not None:
            self.http.close()
            self.http = None


def _bound(host: str, port: int, endpoint: str, flag: str,
           zero: str = "0 turns {endpoint} off in `pdserve serve`") -> socket.socket:
    """A TCP socket bound to host:port (SO_REUSEADDR: as a server binds, past a closed
    connection's TIME_WAIT, never beside a listener); a clear error when it cannot be."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot bind the {endpoint} endpoint to {host}:{port} ({e.strerror}); pick a free "
                           f"--{flag}-port ({zero.format(endpoint=endpoint)})") from e
    return sock


def bind_http(host: str, port: int) -> socket.socket:
    """The HTTP endpoint's socket on host:port (0: any free port), non-blocking, not yet listening."""
    sock = _bound(host, port, "HTTP", "http")
    sock.setblocking(False)
    return sock


def claim_grpc(host: str, port: int) -> socket.socket:
    """A placeholder holding host:port until the gRPC server binds it."""
    return _bound(host, port, "gRPC", "grpc")


def claim_metrics(host: str, port: int) -> socket.socket:
    """A placeholder holding host:port until the metrics server binds it."""
    return _bound(host, port, "metrics", "metrics", zero="0 picks any free port")


def claim_ports(host: str, grpc_port: int, http_port: int, metrics_port: int = 0) -> PortClaims:
    """Claim the ports given (for gRPC and HTTP a port of 0 turns that frontend off, as in
    `pdserve serve`; for metrics it means any free port, picked later); all or none: a
    claim that fails releases the ones before it."""
    claims = PortClaims()
    try:
        if grpc_port:
            claims.grpc = claim_grpc(host, grpc_port)
        if http_port:
            claims.http = bind_http(host, http_port)
        if metrics_port:
            claims.metrics = claim_metrics(host, metrics_port)
    except BaseException:
        claims.release()
        raise
    return claims

"""Transfer settings a worker is started with."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvtransfer.registry import available_backends, create_engine
from kvtransfer.engine import TransferEngine


@dataclass(frozen=True)
class TransferSettings:
    backend: str = "auto"          # "auto" = the fastest installed
    host: str = "127.0.0.1"        # this node's address: side channels bind here only ("" = on_node())
    side_channel_port: int = 0     # nixl metadata side channel / tcp data socket; 0 = any free port
    lease_ttl: float = 30.0
    timeout: float = 10.0
    # the cluster's shared secret for the side channels (kvtransfer/peer_auth.py); never printed
    secret: str = field(default="", repr=False)

    def on_node(self, node_address: str) -> "TransferSettings":
        """These settings for a worker on the node with `node_address`: a cluster's settings
        leave `host` empty, since each worker binds (and advertises) its own node's address."""
        return self if self.host else replace(self, host=node_address)

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return available_backends()[0]

    def create(self, name: str) -> TransferEngine:
        if not self.host:
            raise ValueError("TransferSettings.host is empty: call on_node(<this node's address>) first")
        backend = self.resolved_backend()
        return create_engine(backend, name, _backend_config(backend, self.host, self.side_channel_port,
                                                            self.secret.encode()))


def _backend_config(backend: str, host: str, port: int, secret: bytes) -> Any:
    if backend == "nixl":
        from kvtransfer.nixl_backend import NixlConfig
        return NixlConfig(host=host, side_channel_port=port, secret=secret)
    if backend == "tcp":
        from kvtransfer.tcp_backend import TcpConfig
        return TcpConfig(host=host, port=port, secret=secret)
    if backend == "ucxx":
        from kvtransfer.ucxx_backend import UcxxConfig
        return UcxxConfig(host=host)
    raise ValueError(f"unknown transfer backend {backend!r}")

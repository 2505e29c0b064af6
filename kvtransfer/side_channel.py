"""Metadata side channel: a source serves its transfer-agent metadata on host:port.

NIXL 1.5's own listener (``nixlAgentConfig.useListenThread``) binds 0.0.0.0
and cannot be given an address, so the NIXL backend starts this small
threaded TCP server instead, bound to exactly the configured host (never a
wildcard address; port 0 = any free port, reported by ``address``).

Protocol (one request per connection), after the membership check of
``peer_auth`` (a reader without the cluster's secret gets nothing):

    reader -> source   b"PDMD1 " + agent_name + b"\\n"
    source -> reader   b"PDMD" | u16 status | u16 len(incarnation) | u32 len(metadata)
                       | incarnation | metadata

status 0 = ok, 1 = the source is not ``agent_name`` (a stale address).
``incarnation`` is a random id chosen when the source engine started, so a
reader can tell a restarted peer (same name, new memory) from the one it cached.

What it exposes: the agent's metadata blob (for NIXL: agent name, UCX worker
address, and per registered region its base address, length and remote key):
enough for a reader to read the registered pool, so bind it to an address
only cluster members can reach.
"""
from __future__ import annotations

import ipaddress
import socket
import socketserver
import struct
import threading
from dataclasses import dataclass
from typing import Callable

from kvtransfer.peer_auth import PeerAuthError, accept_peer, join_peer

_REQUEST = b"PDMD1 "
_MAGIC = b"PDMD"
_HEADER = struct.Struct("!4sHHI")
_MAX_NAME = 1024
_MAX_METADATA = 64 << 20
STATUS_OK, STATUS_WRONG_AGENT = 0, 1


class SideChannelError(ConnectionError):
    """The peer's side channel could not be reached or answered wrongly."""


@dataclass(frozen=True)
class SideChannelReply:
    agent_name: str
    incarnation: str
    metadata: bytes


def check_bind_host(host: str) -> None:
    """ValueError unless ``host`` names one address (no wildcard / empty host)."""
    if not host or host == "*":
        raise ValueError("the metadata side channel needs this node's address (e.g. 127.0.0.1 "
                         "or the pod IP), got an empty host")
    try:
        unspecified = ipaddress.ip_address(host.split("%")[0]).is_unspecified
    except ValueError:  # a host name: resolved at bind time
        return
    if unspecified:
        raise ValueError(f"refusing to bind the metadata side channel to wildcard address {host!r}: "
                         "use this node's address (e.g. 127.0.0.1 or the pod IP)")


def _resolve(host: str, port: int) -> tuple[int, tuple]:
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    check_bind_host(str(sockaddr[0]))   # a name that resolves to a wildcard is refused too
    return family, sockaddr


class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(self.server.io_timeout_s)
        try:
            if not accept_peer(sock, self.server.owner.secret):
                return
            line = _read_line(sock)
        except (OSError, ValueError):
            return
        if not line.startswith(_REQUEST):
            return
        owner = self.server.owner
        if line[len(_REQUEST):].decode("utf-8", "replace") != owner.agent_name:
            sock.sendall(_HEADER.pack(_MAGIC, STATUS_WRONG_AGENT, 0, 0))
            return
        inc, md = owner.incarnation.encode(), owner.metadata_fn()
        try:
            sock.sendall(_HEADER.pack(_MAGIC, STATUS_OK, len(inc), len(md)) + inc + md)
        except OSError:
            return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: "MetadataServer"
    io_timeout_s: float


class MetadataServer:
    """Serves ``metadata_fn()`` (called per request, so it is always current)."""

    def __init__(self, host: str, port: int, agent_name: str, incarnation: str,
                 metadata_fn: Callable[[], bytes], io_timeout_s: float = 5.0, secret: bytes = b"") -> None:
        check_bind_host(host)
        if not 0 <= port < 65536:
            raise ValueError(f"side channel port must be in [0, 65536) (0 = any free port), got {port}")
        self.agent_name, self.incarnation, self.metadata_fn = agent_name, incarnation, metadata_fn
        self.secret = secret
        family, sockaddr = _resolve(host, port)
        server_cls = type("_BoundServer", (_Server,), {"address_family": family})
        self._server = server_cls(sockaddr, _Handler)
        self._server.owner, self._server.io_timeout_s = self, io_timeout_s
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread: threading.Thread | None = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        daemon=True, name=f"kv-side-channel-{agent_name}")
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """The bound (ip, port)."""
        return self._server.server_address[:2]

    def close(self) -> None:
        if self._thread is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2)
        self._thread = None


def fetch_metadata(host: str, port: int, agent_name: str, timeout: float = 5.0,
                   secret: bytes = b"") -> SideChannelReply:
    """Ask the side channel at host:port for ``agent_name``'s metadata.

    Raises ConnectionError when the peer is unreachable, is not ``agent_name``
    or answers garbage; never blocks longer than ``timeout`` per socket call."""
    if not host or port <= 0:
        raise ValueError(f"peer {agent_name!r} has no side channel address (host={host!r}, port={port})")
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            join_peer(sock, secret, f"the side channel of {agent_name!r} at {host}:{port}")
            sock.sendall(_REQUEST + agent_name.encode() + b"\n")
            magic, status, inc_len, md_len = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
            if magic != _MAGIC:
                raise SideChannelError(f"{host}:{port} is not a pdserve metadata side channel")
            if status == STATUS_WRONG_AGENT:
                raise SideChannelError(f"{host}:{port} does not serve agent {agent_name!r} (stale PeerInfo?)")
            if status != STATUS_OK or md_len > _MAX_METADATA:
                raise SideChannelError(f"bad side channel reply from {host}:{port} (status {status})")
            incarnation = _recv_exact(sock, inc_len).decode()
            return SideChannelReply(agent_name, incarnation, _recv_exact(sock, md_len))
    except (SideChannelError, PeerAuthError):
        raise
    except OSError as exc:  # refused, timed out, reset
        raise SideChannelError(f"cannot fetch metadata of {agent_name!r} from {host}:{port}: {exc!r}") from exc


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buf = bytearray()
    while len(buf) < nbytes:
        chunk = sock.recv(min(nbytes - len(buf), 1 << 20))
        if not chunk:
            raise SideChannelError("side channel closed mid-reply")
        buf += chunk
    return bytes(buf)


def _read_line(sock: socket.socket) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        if len(buf) > _MAX_NAME + len(_REQUEST):
            raise ValueError("request line too long")
        chunk = sock.recv(256)
        if not chunk:
            raise ValueError("closed before a full request")
        buf += chunk
    return bytes(buf[:-1])

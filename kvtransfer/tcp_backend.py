"""Plain-TCP transfer engine: no extra dependency, the always-available reference.

The source listens on ``host:port`` (default 127.0.0.1 and an OS-chosen
port, reported in ``peer_info()``) and serves block reads straight from its
registered memory. One read = one request on a pooled connection:

    reader -> source: header(name, n descriptors, notify) + n x (src_addr, nbytes)
    source -> reader: status byte, then the bytes of every descriptor in order
    reader -> source: ack byte, after every byte landed; the source then
                      queues Notification(reader name, notify)

With a read guard set (``set_read_guard``, e.g. the prefill worker's lease
table), a read carrying a notify message is served only while the guard
holds it (status ``GONE`` otherwise: the lease ended, the blocks may be
reused), and the guard keeps the blocks until the bytes are out.

Every connection starts with the membership check of ``peer_auth`` (HMAC
over ``TcpConfig.secret``): a reader without the cluster's secret gets no
byte. The source checks that every requested range lies inside its pool.
DRAM pools only (a VRAM pool would need staging: use the nixl backend).
"""
from __future__ import annotations

import collections
import ctypes
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

from kvtransfer.descriptors import Descriptor, build_descriptors
from kvtransfer.head_plan import Segment, segment_descriptors
from kvtransfer.engine import (Notification, PeerInfo, ReadGuard, TransferEngine, TransferHandle,
                               TransferStatus)
from kvtransfer.layout import KVPoolLayout
from kvtransfer.peer_auth import accept_peer, join_peer

_HDR = struct.Struct("!4sHII")  # magic, name len, descriptor count, notify len
_DESC = struct.Struct("!QQ")
_MAGIC = b"PDKV"
_OK, _BAD, _ACK, _GONE = b"\x00", b"\x01", b"\x02", b"\x03"


@dataclass(frozen=True)
class TcpConfig:
    host: str = "127.0.0.1"
    port: int = 0
    io_timeout_s: float = 10.0
    socket_buffer_bytes: int = 4 << 20
    secret: bytes = field(default=b"", repr=False)   # the cluster's shared secret (peer_auth)

    def __post_init__(self) -> None:
        if self.host in ("0.0.0.0", "::", ""):
            raise ValueError("bind the tcp backend to this node's address (e.g. 127.0.0.1 or "
                             "the pod IP), not a wildcard address")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536) (0 = pick a free port), got {self.port}")


def _memory(addr: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        got += n


def _tune(sock: socket.socket, config: TcpConfig) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, config.socket_buffer_bytes)
    sock.settimeout(config.io_timeout_s)


class TcpHandle(TransferHandle):
    def __init__(self, descriptors: int, nbytes: int) -> None:
        super().__init__(descriptors, nbytes)
        self._done = threading.Event()
        self._status = TransferStatus.PENDING
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()          # orders attach() against abandon()
        self._abandoned = False
        self._reader: Optional[threading.Thread] = None

    def finish(self, status: TransferStatus, error: Optional[str] = None) -> None:
        if self._status is TransferStatus.PENDING:
            self._status, self.error = status, error
        self._done.set()

    def poll(self) -> TransferStatus:
        return self._status

    def wait(self, timeout: float) -> TransferStatus:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if not self._done.wait(timeout):
            self.abandon()
            return TransferStatus.TIMEOUT
        return self._status

    def attach(self, sock: socket.socket) -> bool:
        """The reader thread's socket, before any byte lands; False once abandoned."""
        with self._lock:
            if self._abandoned:
                return False
            self._sock = sock
            return True

    def abandon(self) -> None:
        """Stop the read for good: when this returns, no byte of it lands in the
        destination blocks any more, so the caller may free and reuse them.
        ``close()`` alone does not wake a thread blocked in ``recv`` on Linux;
        ``shutdown`` does, and the reader thread is then waited for."""
        self.finish(TransferStatus.TIMEOUT, "timed out")
        with self._lock:
            self._abandoned = True
            sock, reader = self._sock, self._reader
        if sock is None:
            return   # not connected yet: attach() refuses, nothing was written
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass     # already closed by the reader
        if reader is not None and reader is not threading.current_thread():
            reader.join()


class TcpEngine(TransferEngine):
    backend_name = "tcp"
    reads_segments = True
    sees_reads = True

    def __init__(self, name: str, config: TcpConfig = TcpConfig()) -> None:
        super().__init__(name)
        self.config = config
        self._notifs: collections.deque[Notification] = collections.deque()
        self._idle: dict[tuple[str, int], list[socket.socket]] = collections.defaultdict(list)
        self._lock = threading.Lock()
        self._listener: Optional[socket.socket] = None
        self._closed = threading.Event()
        self._guard: Optional[ReadGuard] = None

    # -- source side -------------------------------------------------------
    def register_pool(self, layout: KVPoolLayout) -> None:
        if layout.mem_type != "DRAM":
            raise ValueError("the tcp backend serves DRAM pools only: use backend 'nixl' for VRAM")
        if self._layout is not None:
            raise ValueError("a pool is already registered: use one engine per pool")
        self._layout = layout
        sock = socket.create_server((self.config.host, self.config.port))
        self._listener = sock
        threading.Thread(target=self._accept_loop, daemon=True, name=f"tcp-accept-{self.name}").start()

    def peer_info(self) -> PeerInfo:
        if self._listener is None:
            raise ValueError("no pool registered: call register_pool(...) first")
        host, port = self._listener.getsockname()[:2]
        return PeerInfo(self.backend_name, self.name, self.layout, host=host, port=port)

    def set_read_guard(self, guard: ReadGuard) -> None:
        self._guard = guard

    def get_notifications(self) -> list[Notification]:
        out = []
        while self._notifs:
            out.append(self._notifs.popleft())
        return out

    def _accept_loop(self) -> None:
        listener = self._listener
        while listener is not None and not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            _tune(conn, self.config)
            conn.settimeout(None)  # idle pooled connections wait for the next request
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(self.config.io_timeout_s)   # a silent stranger cannot hold a thread
                if not accept_peer(conn, self.config.secret):
                    return
                conn.settimeout(None)
                while self._serve_one(conn):
                    pass
            except (OSError, ConnectionError, struct.error):
                return  # reader went away: it sees the failure on its side

    def _serve_one(self, conn: socket.socket) -> bool:
        head = conn.recv(_HDR.size, socket.MSG_WAITALL)
        if len(head) < _HDR.size:
            return False
        magic, name_len, count, notify_len = _HDR.unpack(head)
        if magic != _MAGIC:
            return False
        body = _recv_exact(conn, name_len + count * _DESC.size + notify_len)
        peer = body[:name_len].decode()
        ranges = [_DESC.unpack_from(body, name_len + i * _DESC.size) for i in range(count)]
        notify = body[name_len + count * _DESC.size:]
        if not all(self.layout.contains(a, n) for a, n in ranges):
            conn.sendall(_BAD)
            return True
        guard, key = self._guard, notify.decode("utf-8", errors="replace")
        if guard is not None and notify and not guard.begin_read(key):
            conn.sendall(_GONE)
            return True
        conn.settimeout(self.config.io_timeout_s)   # a stalled reader must not hold the blocks forever
        try:
            conn.sendall(_OK)
            for addr, nbytes in ranges:
                conn.sendall(_memory(addr, nbytes))
            if conn.recv(1, socket.MSG_WAITALL) != _ACK:
                return False
        finally:
            if guard is not None and notify:
                guard.end_read(key)
        conn.settimeout(None)
        if notify:
            self._notifs.append(Notification(peer, notify))
        return True

    # -- reader side -------------------------------------------------------
    def connect(self, peer: PeerInfo) -> None:
        self._check_peer(peer)
        if not peer.port:
            raise ValueError(f"peer {peer.agent_name!r} has no port: pass the PeerInfo its "
                             "engine returned after register_pool()")
        key = (peer.host, peer.port)
        with self._lock:
            if self._idle[key]:
                return
        sock = socket.create_connection(key, timeout=self.config.io_timeout_s)
        _tune(sock, self.config)
        try:
            join_peer(sock, self.config.secret, f"KV source {peer.agent_name!r} at {peer.host}:{peer.port}")
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self._idle[key].append(sock)

    def read(self, peer: PeerInfo, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             notify: bytes = b"") -> TransferHandle:
        self._check_peer(peer)
        return self._start_read(peer, build_descriptors(peer.layout, self.layout, src_block_ids, dst_block_ids),
                                notify)

    def read_segments(self, peer: PeerInfo, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                      segments: Sequence[Segment], notify: bytes = b"") -> TransferHandle:
        self._check_peer(peer)
        descs = segment_descriptors(peer.layout, self.layout, src_block_ids, dst_block_ids, segments)
        return self._start_read(peer, descs, notify)

    def _start_read(self, peer: PeerInfo, descs: list[Descriptor], notify: bytes) -> TransferHandle:
        handle = TcpHandle(len(descs), sum(d.nbytes for d in descs))
        handle._reader = threading.Thread(target=self._run_read, args=(peer, descs, notify, handle),
                                          daemon=True, name=f"tcp-read-{self.name}")
        handle._reader.start()
        return handle

    def _run_read(self, peer: PeerInfo, descs: list[Descriptor], notify: bytes,
                  handle: TcpHandle) -> None:
        key = (peer.host, peer.port)
        try:
            self.connect(peer)
            with self._lock:
                sock = self._idle[key].pop()
            if not handle.attach(sock):
                sock.close()
                return
            name = self.name.encode()
            sock.sendall(_HDR.pack(_MAGIC, len(name), len(descs), len(notify)) + name
                         + b"".join(_DESC.pack(d.src_addr, d.nbytes) for d in descs) + notify)
            status = _recv_exact(sock, 1)
            if status == _GONE:
                raise ValueError("source no longer holds these blocks (lease ended or source "
                                 "restarted): recompute")
            if status != _OK:
                raise ValueError("source rejected the request: block ranges outside its pool")
            for d in descs:
                _recv_into(sock, _memory(d.dst_addr, d.nbytes))
            sock.sendall(_ACK)
        except (OSError, ConnectionError, ValueError) as exc:
            if handle._sock is not None:
                handle._sock.close()
            handle.finish(TransferStatus.FAILED, repr(exc))
            return
        if handle.poll() is TransferStatus.PENDING:  # not abandoned: keep the connection
            with self._lock:
                self._idle[key].append(sock)
        handle.finish(TransferStatus.DONE)

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            for socks in self._idle.values():
                for s in socks:
                    s.close()
            self._idle.clear()

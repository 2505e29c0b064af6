"""Transfer engine over UCX's Python bindings (``ucxx-cu12``, optional extra).

ucxx exposes tag messaging, not one-sided RMA, so a read is a small
request/response on tags. Peers reach each other by UCX worker address
(``peer_info().metadata``), so no listener socket is opened; UCX's transports
bind where ``UCX_NET_DEVICES`` says (``lo`` for a loopback host, see ucx_env).

    reader: posts one tag receive per descriptor straight into its pool,
            then sends header (tag 1) + body (reader address, name, ranges, notify)
    source: checks the ranges lie in its pool, tag-sends each range from its pool
    reader: after the last byte landed, sends an ack; the source queues the notification

A UCX progress thread in blocking (event) mode drives both sides: it sleeps
on the worker's event fd, so an idle engine costs no CPU.
"""
from __future__ import annotations

import collections
import ctypes
import importlib.util
import random
import struct
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kvtransfer import ucx_env
from kvtransfer.descriptors import Descriptor, build_descriptors
from kvtransfer.engine import (Notification, PeerInfo, TransferEngine, TransferHandle,
                               TransferStatus)
from kvtransfer.layout import KVPoolLayout

_REQ_TAG = 1
_HDR = struct.Struct("!QQ")          # body tag base, body length
_BODY = struct.Struct("!HHI")        # address len, name len, descriptor count
_DESC = struct.Struct("!QQ")
_OK, _BAD = 0, 1


@dataclass(frozen=True)
class UcxxConfig:
    host: str = "127.0.0.1"          # picks UCX_NET_DEVICES=lo when loopback; nothing binds to it
    poll_interval_s: float = 0.0001


def ucxx_available() -> bool:
    """Installed? (found without importing: ``import ucxx`` edits os.environ)."""
    return importlib.util.find_spec("ucxx") is not None


def ucxx_defaults(host: str) -> dict[str, str]:
    """Shared UCX defaults plus host-memory rendezvous (ucxx's import would
    pick ``UCX_RNDV_FRAG_MEM_TYPE=cuda``) and put_zcopy (1.5 vs 0.5 GB/s here)."""
    return {**ucx_env.ucx_defaults(host), "UCX_RNDV_FRAG_MEM_TYPE": "host",
            "UCX_RNDV_SCHEME": "put_zcopy"}


def _array(addr: int, nbytes: int):
    from ucxx._lib.arr import Array
    return Array(np.frombuffer(memoryview((ctypes.c_char * nbytes).from_address(addr)), dtype=np.uint8))


def _wait_all(requests, deadline: Optional[float], interval: float) -> bool:
    while not all(r.completed for r in requests):
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(interval)
    for r in requests:
        r.check_error()
    return True


class UcxxHandle(TransferHandle):
    def __init__(self, descriptors: int, nbytes: int) -> None:
        super().__init__(descriptors, nbytes)
        self._status = TransferStatus.PENDING
        self.requests: list = []

    def finish(self, status: TransferStatus, error: Optional[str] = None) -> None:
        if self._status is TransferStatus.PENDING:
            self._status, self.error = status, error

    def poll(self) -> TransferStatus:
        return self._status

    def abandon(self) -> None:
        self.finish(TransferStatus.TIMEOUT, "timed out")


class UcxxEngine(TransferEngine):
    backend_name = "ucxx"

    def __init__(self, name: str, config: UcxxConfig = UcxxConfig()) -> None:
        super().__init__(name)
        self.config = config
        with ucx_env.scoped_defaults(ucxx_defaults(config.host)) as applied:
            self.applied_env = applied
            import ucxx._lib.libucxx as api
            self.api = api
            self.ctx = api.UCXContext(feature_flags=(api.Feature.TAG, api.Feature.WAKEUP))
            self.worker = api.UCXWorker(self.ctx)
        self.worker.start_progress_thread(polling_mode=False)
        self.address = self.worker.address.tobytes()
        self._eps: dict[bytes, object] = {}
        self._lock = threading.Lock()
        self._notifs: collections.deque[Notification] = collections.deque()
        self._closed = threading.Event()
        self._server: Optional[threading.Thread] = None

    def _endpoint(self, address: bytes):
        with self._lock:
            ep = self._eps.get(address)
            if ep is None:
                addr = self.api.UCXAddress.create_from_buffer(address)
                ep = self.worker.create_endpoint_from_worker_address(addr, endpoint_error_handling=True)
                self._eps[address] = ep
        return ep

    # -- source side -------------------------------------------------------
    def register_pool(self, layout: KVPoolLayout) -> None:
        if layout.mem_type != "DRAM":
            raise ValueError("the ucxx backend serves DRAM pools here: use backend 'nixl' for VRAM")
        if self._layout is not None:
            raise ValueError("a pool is already registered: use one engine per pool")
        self._layout = layout
        self._server = threading.Thread(target=self._serve_loop, daemon=True, name=f"ucxx-{self.name}")
        self._server.start()

    def peer_info(self) -> PeerInfo:
        return PeerInfo(self.backend_name, self.name, self.layout, metadata=self.address)

    def get_notifications(self) -> list[Notification]:
        out = []
        while self._notifs:
            out.append(self._notifs.popleft())
        return out

    def _serve_loop(self) -> None:
        while not self._closed.is_set():
            hdr = np.zeros(_HDR.size, dtype=np.uint8)
            req = self.worker.tag_recv(self._wrap(hdr), self.api.UCXXTag(_REQ_TAG))
            while not req.completed:
                if self._closed.wait(self.config.poll_interval_s * 10):
                    return
            try:
                req.check_error()
                base, length = _HDR.unpack(hdr.tobytes())
                threading.Thread(target=self._serve_one, args=(base, length), daemon=True).start()
            except Exception:
                continue

    def _wrap(self, arr: np.ndarray):
        from ucxx._lib.arr import Array
        return Array(arr)

    def _serve_one(self, base: int, length: int) -> None:
        tag = self.api.UCXXTag
        body = np.zeros(length, dtype=np.uint8)
        try:
            if not _wait_all([self.worker.tag_recv(self._wrap(body), tag(base))],
                             time.monotonic() + 10, self.config.poll_interval_s):
                return
            raw = body.tobytes()
            alen, nlen, count = _BODY.unpack_from(raw)
            off = _BODY.size
            address, name = raw[off:off + alen], raw[off + alen:off + alen + nlen].decode()
            off += alen + nlen
            ranges = [_DESC.unpack_from(raw, off + i * _DESC.size) for i in range(count)]
            notify = raw[off + count * _DESC.size:]
            ep = self._endpoint(address)
            ok = all(self.layout.contains(a, n) for a, n in ranges)
            status = np.array([_OK if ok else _BAD], dtype=np.uint8)
            reqs = [ep.tag_send(self._wrap(status), tag(base + 1))]
            if ok:
                reqs += [ep.tag_send(_array(a, n), tag(base + 3 + i)) for i, (a, n) in enumerate(ranges)]
            ack = np.zeros(1, dtype=np.uint8)
            reqs.append(self.worker.tag_recv(self._wrap(ack), tag(base + 2)))
            if _wait_all(reqs, time.monotonic() + 60, self.config.poll_interval_s) and ok and notify:
                self._notifs.append(Notification(name, notify))
        except Exception:
            return  # reader went away: it sees the failure on its side

    # -- reader side -------------------------------------------------------
    def connect(self, peer: PeerInfo) -> None:
        self._check_peer(peer)
        self._endpoint(peer.metadata)

    def read(self, peer: PeerInfo, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             notify: bytes = b"") -> TransferHandle:
        self._check_peer(peer)
        descs = build_descriptors(peer.layout, self.layout, src_block_ids, dst_block_ids)
        handle = UcxxHandle(len(descs), sum(d.nbytes for d in descs))
        threading.Thread(target=self._run_read, args=(peer, descs, notify, handle), daemon=True).start()
        return handle

    def _run_read(self, peer: PeerInfo, descs: list[Descriptor], notify: bytes,
                  handle: UcxxHandle) -> None:
        tag = self.api.UCXXTag
        base = random.getrandbits(40) << 20
        try:
            ep = self._endpoint(peer.metadata)
            name = self.name.encode()
            body = (_BODY.pack(len(self.address), len(name), len(descs)) + self.address + name
                    + b"".join(_DESC.pack(d.src_addr, d.nbytes) for d in descs) + notify)
            status = np.full(1, 255, dtype=np.uint8)
            recvs = [self.worker.tag_recv(self._wrap(status), tag(base + 1))]
            recvs += [self.worker.tag_recv(_array(d.dst_addr, d.nbytes), tag(base + 3 + i))
                      for i, d in enumerate(descs)]
            hdr = np.frombuffer(_HDR.pack(base, len(body)), dtype=np.uint8).copy()
            body_arr = np.frombuffer(body, dtype=np.uint8).copy()
            sends = [ep.tag_send(self._wrap(hdr), tag(_REQ_TAG)), ep.tag_send(self._wrap(body_arr), tag(base))]
            while handle.poll() is TransferStatus.PENDING:
                if _wait_all(recvs[:1], time.monotonic() + 0.05, self.config.poll_interval_s):
                    break
            if status[0] != _OK:
                raise ValueError("source rejected the request: block ranges outside its pool")
            while handle.poll() is TransferStatus.PENDING:
                if _wait_all(recvs + sends, time.monotonic() + 0.05, self.config.poll_interval_s):
                    ack = np.ones(1, dtype=np.uint8)
                    _wait_all([ep.tag_send(self._wrap(ack), tag(base + 2))], None, self.config.poll_interval_s)
                    handle.finish(TransferStatus.DONE)
        except Exception as exc:
            handle.finish(TransferStatus.FAILED, repr(exc))

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._server is not None:
            self._server.join(timeout=2)
        self.worker.stop_progress_thread()
        self._eps.clear()

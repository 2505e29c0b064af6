"""NIXL (UCX backend) transfer engine: DRAM and VRAM pools from the same code.

Metadata exchange goes through our side channel (``side_channel.py``): each
engine serves its NIXL agent metadata (``getLocalMD``: UCX worker address and
the registered regions' addresses and remote keys) on
``NixlConfig.side_channel_host:side_channel_port`` (default: ``host`` and
port 0 = any free port; wildcard addresses are refused). ``peer_info()``
carries that host/port and an incarnation id; a reader fetches the metadata
on connect, caches it by (agent name, incarnation) and refetches after the
peer restarted. NIXL's own listener is not used: it binds 0.0.0.0 and takes
no address. No etcd. UCX's own tcp transport listens on the interfaces of
``UCX_NET_DEVICES`` (``lo`` by default for a loopback host).

The three traps of NIXL 1.5.1 (see docs/kvtransfer.md) are handled here:
1. ``nixl_agent`` hard-codes a zero-delay progress thread that busy-spins a
   core. We build the agent from ``nixl._bindings`` and set ``pthrDelay``.
2. With the progress thread off, a passive (source) agent must keep calling
   progress or readers stay in PROC forever: we then run a small Python
   thread that calls ``getNotifs`` every ``passive_poll_interval_s`` while
   reads are expected (``expect_reads(True)``: the prefill worker's prompts
   in flight and leases) and every ``passive_idle_poll_interval_s`` otherwise
   (at 0.5 ms, five idle workers' pollers alone kept 0.14 cores busy).
3. ``UCX_TLS`` without a network transport (e.g. ``sm,self``) needs
   ``ucx_error_handling_mode=none``: chosen automatically.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from kvtransfer import side_channel, ucx_env
from kvtransfer.descriptors import Descriptor, build_descriptors
from kvtransfer.head_plan import Segment, segment_descriptors
from kvtransfer.engine import (Notification, PeerInfo, TransferEngine, TransferHandle,
                               TransferStatus)
from kvtransfer.layout import KVPoolLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NixlConfig:
    """progress_thread: NIXL's own progress thread, woken every
    ``progress_delay_us`` (0 would busy-spin a core). When off (the default:
    faster here, see docs/kvtransfer.md), the reader progresses its own
    transfer while it polls, and a Python thread progresses the passive side
    every ``passive_poll_interval_s`` while reads are expected (``expect_reads``),
    else every ``passive_idle_poll_interval_s`` (a read then waits up to that long).
    ``host``: this node's address; the metadata side channel binds to
    ``side_channel_host`` (None = ``host``) : ``side_channel_port`` (0 = any
    free port) and never to a wildcard address; a loopback ``host`` also
    picks UCX_NET_DEVICES=lo. ``side_channel_timeout_s`` bounds a metadata fetch."""
    progress_thread: bool = False
    progress_delay_us: int = 100
    passive_poll_interval_s: float = 0.0005
    passive_idle_poll_interval_s: float = 0.05
    host: str = "127.0.0.1"
    side_channel_host: Optional[str] = None
    side_channel_port: int = 0
    side_channel_timeout_s: float = 5.0
    num_workers: int = 1
    error_handling: Optional[str] = None  # None: "peer", or "none" for shared-memory-only UCX_TLS
    secret: bytes = field(default=b"", repr=False)   # the cluster's shared secret (peer_auth)

    def __post_init__(self) -> None:
        if self.progress_thread and self.progress_delay_us <= 0:
            raise ValueError("progress_delay_us must be > 0 with the progress thread on "
                             "(0 busy-spins a whole core); ~100 is a good value")
        if self.passive_poll_interval_s <= 0:
            raise ValueError("passive_poll_interval_s must be > 0, e.g. 0.0005")
        if self.passive_idle_poll_interval_s < self.passive_poll_interval_s:
            raise ValueError("passive_idle_poll_interval_s must be >= passive_poll_interval_s, e.g. 0.05")
        side_channel.check_bind_host(self.host)
        side_channel.check_bind_host(self.bind_host)
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port must be in [0, 65536) (0 = any free port), "
                             f"got {self.side_channel_port}")
        if self.side_channel_timeout_s <= 0:
            raise ValueError("side_channel_timeout_s must be > 0, e.g. 5.0")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.error_handling not in (None, "peer", "none"):
            raise ValueError("error_handling must be None (auto), 'peer' or 'none'")

    @property
    def bind_host(self) -> str:
        return self.host if self.side_channel_host is None else self.side_channel_host


def nixl_available() -> bool:
    try:
        import nixl._bindings  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA wheel
        return False
    return True


def _status(bind, code) -> TransferStatus:
    if code == bind.NIXL_SUCCESS:
        return TransferStatus.DONE
    if code == bind.NIXL_IN_PROG:
        return TransferStatus.PENDING
    return TransferStatus.FAILED


class NixlHandle(TransferHandle):
    def __init__(self, engine: "NixlEngine", peer: str, req: Optional[int], descriptors: int, nbytes: int,
                 status: TransferStatus, error: Optional[str] = None) -> None:
        super().__init__(descriptors, nbytes)
        self._engine, self._peer, self._req, self._status, self.error = engine, peer, req, status, error
        if status is not TransferStatus.PENDING:
            self._release()

    def poll(self) -> TransferStatus:
        if self._status is TransferStatus.PENDING:
            try:
                with self._engine.lock:
                    self._status = _status(self._engine.bind, self._engine.agent.getXferStatus(self._req))
            except Exception as exc:  # nixlRemoteDisconnectError, nixlBackendError, ...
                self._status, self.error = TransferStatus.FAILED, repr(exc)
            if self._status is not TransferStatus.PENDING:
                self._release()
        return self._status

    def abandon(self, settle_s: float = 5.0) -> None:
        """Give up; return once the posted read no longer writes (see release_request)."""
        self._status, self.error = TransferStatus.TIMEOUT, "timed out"
        req, self._req = self._req, None
        self._engine.mark_stale(self._peer)
        if req is not None:
            self._engine.release_request(req, settle_s)

    def _release(self) -> None:
        if self._status is not TransferStatus.DONE:   # peer may be gone or restarted
            self._engine.mark_stale(self._peer)
        if self._req is not None:
            self._engine.release_request(self._req)
            self._req = None


class NixlEngine(TransferEngine):
    backend_name = "nixl"
    reads_segments = True

    def __init__(self, name: str, config: NixlConfig = NixlConfig()) -> None:
        super().__init__(name)
        import nixl._bindings as bind
        self.bind, self.config = bind, config
        cfg = bind.nixlAgentConfig(config.progress_thread, False)
        cfg.pthrDelay = config.progress_delay_us if config.progress_thread else 0
        if not config.progress_thread:
            cfg.syncMode = bind.NIXL_THREAD_SYNC_STRICT  # our poller thread shares the agent
        with ucx_env.scoped_defaults(ucx_env.ucx_defaults(config.host)) as applied:
            self.applied_env = applied
            err = config.error_handling or (
                "none" if ucx_env.shared_memory_only(os.environ.get("UCX_TLS", "")) else "peer")
            self.agent = bind.nixlAgent(name, cfg)
            self.agent.createBackend("UCX", {"num_workers": str(config.num_workers),
                                             "ucx_error_handling_mode": err})
        self.error_handling = err
        self.lock = threading.Lock()
        self._mem = {"DRAM": bind.DRAM_SEG, "VRAM": bind.VRAM_SEG}
        self._reg = None
        self.incarnation = uuid.uuid4().hex
        self._peers: dict[str, str] = {}   # agent name -> incarnation whose metadata is loaded
        self._stale: set[str] = set()      # peers whose transfer failed: refetch on next connect
        self._stuck: list[int] = []
        self._notifs: collections.deque[Notification] = collections.deque()
        self._stop = threading.Event()
        self._wake = threading.Event()     # set on stop and when reads become expected
        self._expecting = True             # until told otherwise: full rate, as for any source
        self._poller: Optional[threading.Thread] = None
        self._side = side_channel.MetadataServer(config.bind_host, config.side_channel_port, name,
                                                 self.incarnation, self._local_metadata, secret=config.secret)
        if not config.progress_thread:
            self._poller = threading.Thread(target=self._passive_progress, daemon=True,
                                            name=f"nixl-progress-{name}")
            self._poller.start()

    # -- source side -------------------------------------------------------
    def register_pool(self, layout: KVPoolLayout) -> None:
        if self._reg is not None:
            raise ValueError("a pool is already registered: use one engine per pool")
        reg = self.bind.nixlRegDList(self._mem[layout.mem_type],
                                     [(layout.base_addr, layout.total_bytes, layout.device_id, "")])
        with self.lock:
            self.agent.registerMem(reg, [])
        self._reg, self._layout = reg, layout

    def peer_info(self) -> PeerInfo:
        """Name, layout and side channel address; the NIXL metadata itself is
        fetched by the reader over the side channel."""
        return PeerInfo(self.backend_name, self.name, self.layout, host=self._side.host,
                        port=self._side.port, incarnation=self.incarnation)

    @property
    def side_channel_address(self) -> tuple[str, int]:
        return self._side.address

    def _local_metadata(self) -> bytes:
        with self.lock:
            if self.agent is None:
                return b""
            return self.agent.getLocalMD()

    def get_notifications(self) -> list[Notification]:
        self._drain_notifs()
        out = []
        while self._notifs:
            out.append(self._notifs.popleft())
        return out

    def _drain_notifs(self) -> None:
        with self.lock:
            new = self.agent.getNotifs({}, [])
        for peer, msgs in new.items():
            self._notifs.extend(Notification(peer, bytes(m)) for m in msgs)

    def expect_reads(self, active: bool) -> None:
        woke = active and not self._expecting
        self._expecting = active
        if woke:   # out of a slow wait now: the read about to come is progressed at once
            self._wake.set()

    def _passive_progress(self) -> None:
        cfg = self.config
        while True:
            self._wake.wait(cfg.passive_poll_interval_s if self._expecting else cfg.passive_idle_poll_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._drain_notifs()
            except Exception:  # agent torn down under us during close
                log.exception("nixl passive progress failed")
                return

    # -- reader side -------------------------------------------------------
    def connect(self, peer: PeerInfo) -> None:
        self._check_peer(peer)
        name = peer.agent_name
        if self._peers.get(name) == peer.incarnation and name not in self._stale:
            return
        reply = side_channel.fetch_metadata(peer.host, peer.port, name, self.config.side_channel_timeout_s,
                                            secret=self.config.secret)
        if reply.incarnation != peer.incarnation:
            raise ConnectionError(f"NIXL peer {name!r} at {peer.host}:{peer.port} restarted "
                                  f"(incarnation {reply.incarnation}, PeerInfo has {peer.incarnation}): "
                                  "get a fresh PeerInfo")
        with self.lock:
            if name in self._peers:   # an older incarnation, or a failed connection
                self._forget(name)
            try:
                self.agent.loadRemoteMD(reply.metadata)
            except Exception as exc:  # UCX connects eagerly: a dead peer fails here
                raise ConnectionError(f"cannot reach NIXL peer {name!r}: {exc!r}") from exc
            self._peers[name] = peer.incarnation
            self._stale.discard(name)

    def _forget(self, name: str) -> None:
        """Drop a peer's loaded metadata (caller holds the lock)."""
        try:
            self.agent.invalidateRemoteMD(name)
        except Exception:
            log.debug("invalidateRemoteMD(%s) failed", name, exc_info=True)
        self._peers.pop(name, None)

    def mark_stale(self, name: str) -> None:
        """A transfer from ``name`` failed: refetch its metadata before the next read."""
        self._stale.add(name)

    def read(self, peer: PeerInfo, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             notify: bytes = b"") -> TransferHandle:
        return self._start_read(peer, build_descriptors(peer.layout, self.layout, src_block_ids, dst_block_ids),
                                notify)

    def read_segments(self, peer: PeerInfo, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                      segments: Sequence[Segment], notify: bytes = b"") -> TransferHandle:
        descs = segment_descriptors(peer.layout, self.layout, src_block_ids, dst_block_ids, segments)
        return self._start_read(peer, descs, notify)

    def _start_read(self, peer: PeerInfo, descs: list[Descriptor], notify: bytes) -> TransferHandle:
        nbytes = sum(d.nbytes for d in descs)
        try:
            self.connect(peer)
            with self.lock:
                if not descs:
                    if notify:
                        self.agent.genNotif(peer.agent_name, notify)
                    return NixlHandle(self, peer.agent_name, None, 0, 0, TransferStatus.DONE)
                req = self._post(peer, descs, notify)
                code = self.agent.postXferReq(req, notify)
        except Exception as exc:
            return NixlHandle(self, peer.agent_name, None, len(descs), nbytes, TransferStatus.FAILED, repr(exc))
        return NixlHandle(self, peer.agent_name, req, len(descs), nbytes, _status(self.bind, code))

    def _post(self, peer: PeerInfo, descs: list[Descriptor], notify: bytes) -> int:
        arr = np.array([(d.src_addr, d.dst_addr, d.nbytes) for d in descs], dtype=np.uint64)
        local = np.stack([arr[:, 1], arr[:, 2], np.full(len(descs), self.layout.device_id, np.uint64)], 1)
        remote = np.stack([arr[:, 0], arr[:, 2], np.full(len(descs), peer.layout.device_id, np.uint64)], 1)
        bind = self.bind
        return self.agent.createXferReq(
            bind.NIXL_READ, bind.nixlXferDList(self._mem[self.layout.mem_type], local),
            bind.nixlXferDList(self._mem[peer.layout.mem_type], remote), peer.agent_name, notify, [])

    def release_request(self, req: int, settle_s: float = 0.0) -> None:
        """Release a transfer request. NIXL aborts one in progress if it can; one it
        cannot abort is retried for up to ``settle_s`` (until the backend reports it
        ended, so it no longer writes), then left for close()."""
        end = time.monotonic() + settle_s
        while True:
            try:
                with self.lock:
                    self.agent.releaseXferReq(req)
                return
            except Exception:  # still active (peer gone)
                if time.monotonic() >= end:
                    if settle_s:
                        log.error("a NIXL read could not be stopped within %.1f s", settle_s)
                    self._stuck.append(req)
                    return
            time.sleep(0.001)

    def close(self) -> None:
        if getattr(self, "agent", None) is None:
            return
        self._stop.set()
        self._wake.set()
        self._side.close()
        if self._poller is not None:
            self._poller.join(timeout=2)
        with self.lock:
            for req in self._stuck:
                try:
                    self.agent.releaseXferReq(req)
                except Exception:
                    pass
            for peer in list(self._peers):
                self._forget(peer)
            if self._reg is not None:
                self.agent.deregisterMem(self._reg, [])
            self.agent = None

"""The transfer engine contract every backend implements.

Flow (prefill P is the source, decode D reads):

    P: eng = create_engine("nixl", name="prefill-0")
       eng.register_pool(KVPoolLayout.from_tensor(pool))   # keep `pool` alive
       info = eng.peer_info()            # picklable, send through Ray
       leases.pin(request_id, block_ids, ttl)
       ... loop: for n in eng.get_notifications(): leases.release_by_notification(n.message)
    D: eng.connect(info)                 # optional, read() connects on demand
       h = eng.read(info, src_block_ids, dst_block_ids, notify=request_id.encode())
       status = h.wait(timeout=5.0)      # TransferStatus.DONE / FAILED / TIMEOUT
"""
from __future__ import annotations

import abc
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

from kvtransfer.layout import KVPoolLayout

if TYPE_CHECKING:
    from kvtransfer.head_plan import Segment


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class PeerInfo:
    """Everything a reader needs to reach a source; small and picklable.

    ``metadata`` is backend-specific (a UCX worker address); ``host``/``port``
    are set by backends that listen on a socket (tcp: the data socket; nixl:
    the metadata side channel). ``incarnation`` is a random id per engine
    start: a restarted peer keeps its name but gets a new incarnation, so
    readers drop what they cached about the old one.
    """
    backend: str
    agent_name: str
    layout: KVPoolLayout
    host: str = ""
    port: int = 0
    metadata: bytes = field(default=b"", repr=False)
    incarnation: str = ""


@dataclass(frozen=True)
class Notification:
    """Delivered to the source: ``peer_name`` read blocks and sent ``message``."""
    peer_name: str
    message: bytes


class ReadGuard(Protocol):
    """What a source asks before and after serving a read (e.g. LeaseTable)."""

    def begin_read(self, request_id: str) -> bool: ...

    def end_read(self, request_id: str) -> None: ...


class TransferHandle(abc.ABC):
    """One posted read. ``descriptors`` and ``nbytes`` describe what was posted."""

    def __init__(self, descriptors: int, nbytes: int) -> None:
        self.descriptors = descriptors
        self.nbytes = nbytes
        self.error: Optional[str] = None

    @abc.abstractmethod
    def poll(self) -> TransferStatus:
        """Advance and return PENDING, DONE or FAILED without blocking."""

    def wait(self, timeout: float) -> TransferStatus:
        """Block until done/failed, or TIMEOUT after ``timeout`` seconds."""
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        deadline = time.monotonic() + timeout
        spins = 0
        while True:
            status = self.poll()
            if status is not TransferStatus.PENDING:
                return status
            if time.monotonic() >= deadline:
                self.abandon()
                return TransferStatus.TIMEOUT
            spins += 1
            if spins > 1000:  # long transfer: stop burning a core on 2-core hosts
                time.sleep(0.0001)

    def abandon(self) -> None:
        """Give up on a transfer that timed out (cancel / release resources)."""


class TransferEngine(abc.ABC):
    """Abstract block-table-aware transfer engine (one per worker process)."""

    backend_name: str = ""

    def __init__(self, name: str) -> None:
        if not name:
            raise ValueError("an engine needs a non-empty, cluster-unique name, e.g. 'prefill-0'")
        self.name = name
        self._layout: Optional[KVPoolLayout] = None

    @property
    def layout(self) -> KVPoolLayout:
        if self._layout is None:
            raise ValueError("no pool registered: call register_pool(KVPoolLayout.from_tensor(pool)) first")
        return self._layout

    @abc.abstractmethod
    def register_pool(self, layout: KVPoolLayout) -> None:
        """Register this process's pool (the caller keeps its tensor alive)."""

    @abc.abstractmethod
    def peer_info(self) -> PeerInfo:
        """How peers reach this engine (after register_pool)."""

    @abc.abstractmethod
    def connect(self, peer: PeerInfo) -> None:
        """Prepare to read from ``peer`` (idempotent)."""

    @abc.abstractmethod
    def read(self, peer: PeerInfo, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             notify: bytes = b"") -> TransferHandle:
        """Copy ``peer``'s blocks ``src_block_ids`` into our ``dst_block_ids``;
        ``notify`` is delivered to the peer once the read completed."""

    def read_segments(self, peer: PeerInfo, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                      segments: Sequence["Segment"], notify: bytes = b"") -> TransferHandle:
        """As :meth:`read`, but only the byte ``segments`` of each block (a tensor-parallel
        rank's head ranges, planned by :mod:`kvtransfer.head_plan`; the segments' src_rank
        is not looked at: they all come from ``peer``). A segment that is the whole block on
        both sides reads runs of blocks as :meth:`read` does."""
        raise ValueError(f"the {self.backend_name!r} transfer backend cannot read head ranges between "
                         "tensor-parallel workers of different sizes: use the tcp or nixl backend")

    #: whether read_segments() works (byte ranges of blocks: TP head ranges, layer groups)
    reads_segments: bool = False

    #: whether set_read_guard() takes effect: the source sees every read
    #: (tcp) rather than one-sided reads it never hears of (NIXL, UCXX)
    sees_reads: bool = False

    def set_read_guard(self, guard: "ReadGuard") -> None:
        """Source side: bracket every read that carries a notify message with
        ``guard.begin_read(message)`` / ``guard.end_read(message)`` and refuse
        it when ``begin_read`` says no. Ignored by backends with one-sided
        reads (``sees_reads`` False)."""

    def expect_reads(self, active: bool) -> None:
        """Source side: whether peers may read now (a prompt in prefill, a lease held). A
        backend whose passive side must be progressed (nixl without its progress thread)
        polls at full rate while True and backs off to a slow poll while False; a read
        that comes anyway is still served, only later. Others ignore it."""

    @abc.abstractmethod
    def get_notifications(self) -> list[Notification]:
        """Notifications received since the last call (source side)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource; safe to call twice."""

    def _check_peer(self, peer: PeerInfo) -> None:
        if peer.backend != self.backend_name:
            raise ValueError(f"peer {peer.agent_name!r} uses backend {peer.backend!r} but this "
                             f"engine is {self.backend_name!r}: both sides must use the same backend")

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

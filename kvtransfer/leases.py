"""Source-side pins on KV blocks until the reader is done with them.

Every lease ends exactly once: by the read notification, an explicit
release, or expiry (``expire_due(now)``, run periodically by the worker).
``renew(request_id, ttl)`` pushes the expiry out while a reader still waits
(e.g. queued for KV room on the decode node); ``pins`` counts leases ever
pinned, so ``pins == len(table) + sum(releases.values())`` always holds.
The release callback (e.g. the engine freeing the blocks) runs once per
lease; a second release of the same request is a harmless no-op.

Reads in progress hold the blocks past the lease's end. A source that sees
its reads (the tcp backend) brackets each with ``begin_read`` /
``end_read``: ``begin_read`` refuses a lease that is gone (the reader fails
and recomputes instead of copying blocks that may have been reused), and a
lease that ends (expires, or is released) during a read is counted at once
but its blocks are freed only when the read ends. Sources that cannot see
one-sided reads (NIXL) use ``expiry_grace``: the blocks of an expired lease
are freed that many seconds later, so a read posted before the expiry
finishes (or is abandoned by its reader's transfer timeout) first.
"""
from __future__ import annotations

import enum
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


class ReleaseCause(enum.Enum):
    NOTIFIED = "notified"
    RELEASED = "released"
    EXPIRED = "expired"


@dataclass(frozen=True)
class Lease:
    request_id: str
    block_ids: tuple[int, ...]
    expires_at: float


ReleaseCallback = Callable[[Lease, ReleaseCause], None]


class LeaseTable:
    """clock: seconds, e.g. time.monotonic (injected so tests control time)."""

    def __init__(self, clock: Callable[[], float], on_release: ReleaseCallback,
                 expiry_grace: float = 0.0) -> None:
        if expiry_grace < 0:
            raise ValueError(f"expiry_grace must be >= 0 seconds, got {expiry_grace}")
        self._clock = clock
        self._on_release = on_release
        self._grace = expiry_grace
        self._leases: dict[str, Lease] = {}
        self._reading: Counter[str] = Counter()                      # request id -> reads in progress
        self._ended: dict[str, tuple[Lease, ReleaseCause, float]] = {}   # ended, blocks not yet freed
        self._lock = threading.Lock()
        self.releases: Counter[ReleaseCause] = Counter()
        self.pins = 0
        self.renewals = 0

    def pin(self, request_id: str, block_ids: Sequence[int], ttl: float) -> Lease:
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        if not request_id:
            raise ValueError("request_id must be a non-empty string")
        lease = Lease(request_id, tuple(int(b) for b in block_ids), self._clock() + ttl)
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a lease: release it "
                                 "first or use a new request id")
            self._leases[request_id] = lease
            self.pins += 1
        return lease

    def renew(self, request_id: str, ttl: float) -> bool:
        """Expire `ttl` seconds from now (never earlier than already set);
        False if the lease is gone (read, released or expired)."""
        if ttl <= 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            expires = max(lease.expires_at, self._clock() + ttl)
            self._leases[request_id] = Lease(lease.request_id, lease.block_ids, expires)
            self.renewals += 1
        return True

    def release(self, request_id: str, cause: ReleaseCause = ReleaseCause.RELEASED) -> bool:
        """End the lease; False if it was already gone (double release is harmless)."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is None:
                return False
            self.releases[cause] += 1
            free_now = self._end_locked(lease, cause, self._clock())
        if free_now:
            self._on_release(lease, cause)
        return True

    def _end_locked(self, lease: Lease, cause: ReleaseCause, now: float) -> bool:
        """True: free the blocks now; False: kept until the reads end / the grace passes."""
        grace = self._grace if cause is ReleaseCause.EXPIRED else 0.0
        if self._reading[lease.request_id] == 0 and grace == 0:
            return True
        self._ended[lease.request_id] = (lease, cause, now + grace)
        return False

    def begin_read(self, request_id: str) -> bool:
        """A read of this lease's blocks starts; False if the lease is gone."""
        with self._lock:
            if request_id not in self._leases:
                return False
            self._reading[request_id] += 1
            return True

    def end_read(self, request_id: str) -> None:
        """The read begun by ``begin_read`` ended (done or failed)."""
        with self._lock:
            if request_id not in self._reading:
                return   # unmatched: nothing to end
            self._reading[request_id] -= 1
            if self._reading[request_id] > 0:
                return
            del self._reading[request_id]
            ended = self._ended.get(request_id)
            if ended is None or ended[2] > self._clock():
                return
            del self._ended[request_id]
        self._on_release(ended[0], ended[1])

    def release_by_notification(self, message: bytes) -> bool:
        """Release the lease named by a read notification (request id, utf-8)."""
        return self.release(message.decode("utf-8", errors="replace"), ReleaseCause.NOTIFIED)

    def expire_due(self, now: Optional[float] = None) -> list[Lease]:
        now = self._clock() if now is None else now
        free: list[tuple[Lease, ReleaseCause]] = []
        with self._lock:   # re-checked under the lock: a renewal may have moved the expiry
            due = [l for l in self._leases.values() if l.expires_at <= now]
            for lease in due:
                del self._leases[lease.request_id]
                self.releases[ReleaseCause.EXPIRED] += 1
                if self._end_locked(lease, ReleaseCause.EXPIRED, now):
                    free.append((lease, ReleaseCause.EXPIRED))
            for rid, (lease, cause, free_at) in list(self._ended.items()):
                if free_at <= now and self._reading[rid] == 0:
                    del self._ended[rid]
                    free.append((lease, cause))
        for lease, cause in free:
            self._on_release(lease, cause)
        return due

    @property
    def unfreed(self) -> int:
        """Ended leases whose blocks wait for a read to end or the grace to pass."""
        with self._lock:
            return len(self._ended)

    def get(self, request_id: str) -> Optional[Lease]:
        with self._lock:
            return self._leases.get(request_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    @property
    def expiries(self) -> int:
        return self.releases[ReleaseCause.EXPIRED]

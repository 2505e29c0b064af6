"""KV cache events a worker publishes so the router can index its prefixes.

Each event carries a monotonically increasing ``event_id`` per worker; a
consumer that sees a gap asks the worker for a full snapshot (resync).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class KVEventKind(str, Enum):
    STORED = "stored"     # blocks entered the prefix cache (full blocks, hashed)
    REMOVED = "removed"   # blocks left the prefix cache (evicted from every tier)
    CLEARED = "cleared"   # the whole cache was reset


class Tier(str, Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@dataclass(frozen=True)
class KVEvent:
    event_id: int
    kind: KVEventKind
    block_hashes: tuple[int, ...] = ()
    parent_hash: int | None = None   # hash of the block before block_hashes[0] (STORED only)
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True)
class KVSnapshot:
    """Full state for a resync: every cached block hash per tier, and the id
    of the last event already reflected in it."""
    last_event_id: int
    blocks: dict[Tier, tuple[int, ...]] = field(default_factory=dict)


class KVEventLog:
    """The one event stream of a worker's KV cache, shared by every tier so
    event ids stay consecutive whichever tier emits."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self.last_event_id = 0

    def emit(self, kind: KVEventKind, hashes: tuple[int, ...] = (), parent: int | None = None,
             tier: Tier = Tier.DEVICE) -> None:
        self.last_event_id += 1
        self._events.append(KVEvent(self.last_event_id, kind, hashes, parent, tier))

    def stored_chains(self, hashes: list[int], parents: list[int | None], tier: Tier) -> None:
        """One STORED event per run of blocks that chain (each one's parent is
        the block before it)."""
        run: list[int] = []
        run_parent: int | None = None
        for h, parent in zip(hashes, parents, strict=True):
            if run and parent != run[-1]:
                self.emit(KVEventKind.STORED, tuple(run), run_parent, tier)
                run = []
            if not run:
                run_parent = parent
            run.append(h)
        if run:
            self.emit(KVEventKind.STORED, tuple(run), run_parent, tier)

    def drain(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

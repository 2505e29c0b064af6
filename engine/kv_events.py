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

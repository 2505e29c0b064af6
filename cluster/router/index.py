"""`PrefixIndex`: which worker holds which prompt prefix, fed by KV events.

Block hashes are chained (engine/block_hash.py), so one hash names a whole
prefix and the index can be flat: ``hash -> bitmask of workers holding it``.
Matching a prompt walks its hashes once, and-ing the masks: O(prompt blocks)
whatever the number of workers, plus O(1) per worker whose match ends.

Event protocol (engine/kv_events.py), per worker:

- ids are consecutive, a fresh worker's first event has id ``first_event_id``
  (default 1, so a fresh worker's snapshot says ``last_event_id=0``); an id at
  or below the last applied one is a duplicate and skipped; an id above the
  next expected one is a gap: the worker is marked as needing a resync and its
  events are dropped until ``resync(worker_id, snapshot)``;
- STORED adds blocks at the event's tier; a block already indexed moves to
  that tier (a worker reports each block at the fastest tier holding it, so
  a demotion device -> host is a STORED at HOST);
- REMOVED drops blocks from every tier; CLEARED drops all of the worker's.

The event's ``parent_hash`` is not needed: the chained hash already encodes
the position. ``remove_worker`` forgets a dead worker until it reports again
(from ``first_event_id``, or through a resync).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from engine.kv_events import KVEvent, KVEventKind, KVSnapshot, Tier

_RESYNC_ORDER = (Tier.DISK, Tier.HOST, Tier.DEVICE)   # last write wins: the fastest tier


@dataclass(frozen=True, slots=True)
class MatchInfo:
    """Leading prompt blocks one worker holds, by the tier holding them."""
    device_blocks: int
    host_blocks: int = 0
    disk_blocks: int = 0

    @property
    def blocks(self) -> int:
        return self.device_blocks + self.host_blocks + self.disk_blocks


@dataclass(frozen=True, slots=True)
class ApplyResult:
    applied: int                            # events applied to the index
    duplicates: int = 0                     # events at or below the last applied id, skipped
    needs_resync: bool = False              # fetch a KVSnapshot and call resync()
    expected_event_id: int | None = None    # on a gap: the id that was due
    received_event_id: int | None = None    # on a gap: the id that came


class _Worker:
    """Internal per-worker state (mutable, never handed out)."""
    __slots__ = ("bit", "blocks", "next_event_id", "needs_resync")

    def __init__(self, bit: int, next_event_id: int) -> None:
        self.bit = bit
        self.blocks: dict[int, Tier] = {}
        self.next_event_id = next_event_id
        self.needs_resync = False


class PrefixIndex:
    def __init__(self, first_event_id: int = 1) -> None:
        self._first_event_id = first_event_id
        self._held: dict[int, int] = {}        # hash -> mask of workers holding it (any tier)
        self._offloaded: dict[int, int] = {}   # hash -> mask of workers holding it off-device
        self._workers: dict[str, _Worker] = {}
        self._bits: dict[str, int] = {}        # worker id -> bit, kept across removal
        self._ids: list[str] = []              # bit -> worker id

    # ---- events ---------------------------------------------------------
    def apply(self, worker_id: str, events: Iterable[KVEvent]) -> ApplyResult:
        w = self._worker(worker_id)
        if w.needs_resync:
            return ApplyResult(applied=0, needs_resync=True)
        applied = duplicates = 0
        for ev in events:
            if ev.event_id < w.next_event_id:
                duplicates += 1
                continue
            if ev.event_id > w.next_event_id:
                w.needs_resync = True
                return ApplyResult(applied, duplicates, True, w.next_event_id, ev.event_id)
            self._apply_one(w, ev)
            w.next_event_id = ev.event_id + 1
            applied += 1
        return ApplyResult(applied, duplicates)

    def resync(self, worker_id: str, snapshot: KVSnapshot) -> None:
        """Replace everything known about ``worker_id`` by ``snapshot``."""
        w = self._worker(worker_id)
        self._drop_all(w)
        for tier in _RESYNC_ORDER:
            self._store(w, snapshot.blocks.get(tier, ()), tier)
        w.next_event_id = snapshot.last_event_id + 1
        w.needs_resync = False

    def remove_worker(self, worker_id: str) -> None:
        """Forget a dead worker's blocks until it reports again. Idempotent."""
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._drop_all(w)

    def _apply_one(self, w: _Worker, ev: KVEvent) -> None:
        if ev.kind is KVEventKind.STORED:
            self._store(w, ev.block_hashes, ev.tier)
        elif ev.kind is KVEventKind.REMOVED:
            self._remove(w, ev.block_hashes)
        elif ev.kind is KVEventKind.CLEARED:
            self._drop_all(w)
        else:
            raise ValueError(f"unknown KV event kind {ev.kind!r}: use KVEventKind.STORED, "
                             "REMOVED or CLEARED")

    def _store(self, w: _Worker, hashes: Iterable[int], tier: Tier) -> None:
        held, off, blocks, bit = self._held, self._offloaded, w.blocks, w.bit
        device = tier is Tier.DEVICE
        for h in hashes:
            prev = blocks.get(h)
            blocks[h] = tier
            if prev is None:
                held[h] = held.get(h, 0) | bit
                if not device:
                    off[h] = off.get(h, 0) | bit
            elif (prev is Tier.DEVICE) != device:
                if device:
                    _clear_bit(off, h, bit)
                else:
                    off[h] = off.get(h, 0) | bit

    def _remove(self, w: _Worker, hashes: Iterable[int]) -> None:
        blocks, bit = w.blocks, w.bit
        for h in hashes:
            prev = blocks.pop(h, None)
            if prev is None:
                continue
            _clear_bit(self._held, h, bit)
            if prev is not Tier.DEVICE:
                _clear_bit(self._offloaded, h, bit)

    def _drop_all(self, w: _Worker) -> None:
        self._remove(w, list(w.blocks))

    def _worker(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            if not isinstance(worker_id, str) or not worker_id:
                raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")
            bit = self._bits.get(worker_id)
            if bit is None:
                bit = self._bits[worker_id] = 1 << len(self._ids)
                self._ids.append(worker_id)
            w = self._workers[worker_id] = _Worker(bit, self._first_event_id)
        return w

    # ---- queries --------------------------------------------------------
    def match(self, block_hashes: Sequence[int]) -> dict[str, MatchInfo]:
        """Per worker holding at least the first block: its leading prompt
        blocks by tier. Workers holding nothing are absent."""
        out: dict[str, MatchInfo] = {}
        if not block_hashes:
            return out
        held = self._held.get
        off = self._offloaded.get
        alive = held(block_hashes[0], 0)
        slow: dict[int, list[int]] = {}          # bit -> [host, disk] counts
        length = 0
        for h in block_hashes:
            m = held(h, 0) & alive
            if m != alive:
                self._emit(out, alive & ~m, length, slow)
                alive = m
                if not m:
                    return out
            o = off(h)
            if o is not None and o & alive:
                self._count_slow(o & alive, h, slow)
            length += 1
        self._emit(out, alive, length, slow)
        return out

    def _count_slow(self, mask: int, h: int, slow: dict[int, list[int]]) -> None:
        while mask:
            low = mask & -mask
            mask ^= low
            tier = self._workers[self._ids[low.bit_length() - 1]].blocks[h]
            counts = slow.setdefault(low, [0, 0])
            counts[0 if tier is Tier.HOST else 1] += 1

    def _emit(self, out: dict[str, MatchInfo], mask: int, length: int,
              slow: dict[int, list[int]]) -> None:
        ids = self._ids
        while mask:
            low = mask & -mask
            mask ^= low
            counts = slow.get(low)
            if counts is None:
                out[ids[low.bit_length() - 1]] = MatchInfo(length)
            else:
                host, disk = counts
                out[ids[low.bit_length() - 1]] = MatchInfo(length - host - disk, host, disk)

    def worker_blocks(self, worker_id: str) -> Mapping[int, Tier]:
        """Read-only view of the hashes a worker holds and their tiers."""
        w = self._workers.get(worker_id)
        return MappingProxyType(w.blocks if w is not None else {})

    def needs_resync(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.needs_resync

    def last_event_id(self, worker_id: str) -> int | None:
        """Id of the last event reflected for ``worker_id``; None if unknown."""
        w = self._workers.get(worker_id)
        if w is None or w.next_event_id == self._first_event_id:
            return None
        return w.next_event_id - 1

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(self._workers)

    @property
    def num_entries(self) -> int:
        """(worker, block) pairs indexed."""
        return sum(len(w.blocks) for w in self._workers.values())

    @property
    def num_unique_blocks(self) -> int:
        return len(self._held)


def _clear_bit(masks: dict[int, int], h: int, bit: int) -> None:
    m = masks.get(h, 0) & ~bit
    if m:
        masks[h] = m
    else:
        masks.pop(h, None)

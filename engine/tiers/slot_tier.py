"""Bookkeeping of one lower tier (host or disk): slots, LRU and pins.

Every slot is in exactly one state: free; holding a cached block (in the LRU
map, least recently used first); pinned by a swapped-out request; or claimed
by a page-in that has been decided but whose move is not recorded yet.
No tensors here: data moves are recorded as :class:`KVMove` and executed by
:class:`engine.tiers.storage.TierStorage`.
"""
from __future__ import annotations

from collections import OrderedDict

from engine.kv_events import Tier
from engine.tiers.types import TierEntry, cached


class SlotTier:
    def __init__(self, tier: Tier, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"{tier.value} tier: num_slots must be >= 0, got {num_slots}")
        self.tier = tier
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))   # pop() hands out slot 0 first
        self._lru: OrderedDict[int, TierEntry] = OrderedDict()        # hash -> entry
        self._pinned: set[int] = set()
        self._claimed: set[int] = set()

    # ---- sizes ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def room(self) -> int:
        """Slots obtainable now: free ones plus cached ones that can be evicted."""
        return len(self._free) + len(self._lru)

    # ---- cached blocks -------------------------------------------------------
    def lookup(self, block_hash: int) -> TierEntry | None:
        return self._lru.get(block_hash)

    def hashes(self) -> tuple[int, ...]:
        return tuple(self._lru)

    def lru_hashes(self) -> list[int]:
        """Least recently used first (the next to be evicted)."""
        return list(self._lru)

    def pop_free(self) -> int:
        return self._free.pop()

    def pop_lru(self) -> TierEntry:
        """Evict the least recently used cached block; its slot is the caller's."""
        _, entry = self._lru.popitem(last=False)
        return entry

    def insert(self, entry: TierEntry) -> None:
        """Cache ``entry`` (its slot came from pop_free / pop_lru) as most recent."""
        assert entry.tier is self.tier and entry.block_hash is not None
        assert entry.block_hash not in self._lru, f"hash {entry.block_hash:#x} already in {self.tier.value}"
        self._lru[entry.block_hash] = entry

    def discard(self, block_hash: int) -> bool:
        """Drop a cached block (a copy now lives in a faster tier). True if held."""
        entry = self._lru.pop(block_hash, None)
        if entry is None:
            return False
        self._free.append(entry.slot)
        return True

    def clear(self) -> list[int]:
        """Drop every cached block (pins and claims stay); returns their hashes."""
        hashes = list(self._lru)
        self._free.extend(e.slot for e in self._lru.values())
        self._lru.clear()
        return hashes

    # ---- page-in and swap ----------------------------------------------------
    def claim(self, entry: TierEntry) -> None:
        """Take a cached block out of the LRU for a page-in; the slot stays
        reserved until :meth:`release` or :meth:`restore`."""
        key = entry.block_hash
        if key is None:     # private
            assert entry.slot in self._pinned, f"swap slot {entry.slot} is not pinned"
            return
        assert self._lru.get(key) is entry, f"{self.tier.value}: claiming a stale entry"
        del self._lru[key]
        self._claimed.add(entry.slot)

    def release(self, entry: TierEntry) -> None:
        """The page-in's move is recorded: the slot is free again."""
        (self._pinned if entry.is_private else self._claimed).remove(entry.slot)
        self._free.append(entry.slot)

    def restore(self, entry: TierEntry) -> None:
        """Keep a claimed cached block here after copying it up (most recent)."""
        self._claimed.remove(entry.slot)
        self._lru[cached(entry.block_hash)] = entry

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def unpin(self, slot: int) -> None:
        self._pinned.remove(slot)
        self._free.append(slot)

    def pinned_slots(self) -> set[int]:
        return set(self._pinned)

    # ---- integrity -----------------------------------------------------------
    def check(self, errors: list[str]) -> None:
        name = self.tier.value
        cached = [e.slot for e in self._lru.values()]
        parts = [self._free, cached, list(self._pinned), list(self._claimed)]
        every = [s for part in parts for s in part]
        if len(every) != self.num_slots or set(every) != set(range(self.num_slots)):
            errors.append(f"{name} tier: free {len(self._free)} + cached {len(cached)} + pinned "
                          f"{len(self._pinned)} + claimed {len(self._claimed)} slots do not partition "
                          f"its {self.num_slots} slots exactly")
        if self._claimed:
            errors.append(f"{name} tier: slots {sorted(self._claimed)} claimed by an unfinished page-in")
        for block_hash, entry in self._lru.items():
            if entry.block_hash != block_hash or entry.tier is not self.tier:
                errors.append(f"{name} tier: hash {block_hash:#x} maps to an entry for "
                              f"{entry.block_hash} in {entry.tier.value}")
            if entry.token_ids is None:
                errors.append(f"{name} tier: cached hash {block_hash:#x} has no tokens")

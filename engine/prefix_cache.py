"""The device tier's prefix cache: hash -> cached full block, and its events.

:class:`NullPrefixCache` stands in when prefix caching is off, so no caller
checks a flag. Events go to a :class:`~engine.kv_events.KVEventLog` shared
with the lower tiers (engine/tiers/), so ids stay consecutive.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from engine.kv_events import KVEventKind, KVEventLog, KVSnapshot, Tier

if TYPE_CHECKING:
    from engine.block_pool import KVBlock


class PrefixCache:
    """Hash -> block map of cached full blocks of one tier (the device)."""

    def __init__(self, tier: Tier = Tier.DEVICE, log: KVEventLog | None = None) -> None:
        self._by_hash: dict[int, KVBlock] = {}
        self.log = log or KVEventLog()
        self._tier = tier

    def __len__(self) -> int:
        return len(self._by_hash)

    def hashes(self) -> tuple[int, ...]:
        return tuple(self._by_hash)

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._by_hash.get(block_hash)

    def store(self, blocks: Sequence[KVBlock], hashes: Sequence[int],
              token_chunks: Sequence[bytes], parent_hash: int | None) -> None:
        """Cache full blocks of one chain; one STORED event per contiguous run
        of newly stored blocks (a hash another block already holds is skipped).
        ``token_chunks`` are each block's tokens packed by
        :func:`engine.block_hash.packed_tokens`."""
        run: list[int] = []
        run_parent = prev = parent_hash
        for block, block_hash, tokens in zip(blocks, hashes, token_chunks, strict=True):
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            if block_hash in self._by_hash:
                self._emit_stored(run, run_parent)
                run, run_parent = [], block_hash
            else:
                block.block_hash, block.parent_hash, block.token_ids = block_hash, prev, tokens
                self._by_hash[block_hash] = block
                run.append(block_hash)
            prev = block_hash
        self._emit_stored(run, run_parent)

    def forget(self, blocks: Sequence[KVBlock]) -> None:
        """Take blocks out of the map without an event (a lower tier took them)."""
        by_hash = self._by_hash
        for block in blocks:
            if block.block_hash is not None:
                del by_hash[block.block_hash]
                block.block_hash = block.parent_hash = block.token_ids = None     # block.forget_hash()

    def evict(self, blocks: Sequence[KVBlock]) -> None:
        """Take blocks out of the cache for good: one REMOVED event."""
        hashes = tuple(b.block_hash for b in blocks if b.block_hash is not None)
        self.forget(blocks)
        if hashes:
            self.log.emit(KVEventKind.REMOVED, hashes, tier=self._tier)

    def clear(self) -> None:
        for block in self._by_hash.values():
            block.forget_hash()
        self._by_hash.clear()
        self.log.emit(KVEventKind.CLEARED, tier=self._tier)

    def drain_events(self):
        return self.log.drain()

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot(last_event_id=self.log.last_event_id, blocks={self._tier: tuple(self._by_hash)})

    def check(self, errors: list[str]) -> None:
        for block_hash, block in self._by_hash.items():
            if block.block_hash != block_hash:
                errors.append(f"hash {block_hash:#x} maps to block {block.block_id} "
                              f"carrying {block.block_hash}")

    def _emit_stored(self, hashes: list[int], parent_hash: int | None) -> None:
        if hashes:
            self.log.emit(KVEventKind.STORED, tuple(hashes), parent_hash, self._tier)


class NullPrefixCache(PrefixCache):
    """Prefix caching off: nothing is ever stored, so nothing hits or is evicted."""

    def lookup(self, block_hash: int) -> KVBlock | None:
        return None

    def store(self, blocks: Sequence[KVBlock], hashes: Sequence[int],
              token_chunks: Sequence[bytes], parent_hash: int | None) -> None:
        return None

    def clear(self) -> None:
        return None

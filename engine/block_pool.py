"""Physical KV blocks: the free queue in eviction order and the block pool.

A block with ``ref_cnt == 0`` sits in the free queue. If it also carries a
hash it is still in the prefix cache: a later request may *touch* it (cache
hit: out of the queue, ``ref_cnt`` 1) until allocation pops it from the
queue head and evicts it (a REMOVED event). Blocks without a hash are worth
nothing when free, so they go to the queue head and are reused first;
cached blocks go to the tail (least recently used is evicted first).

The prefix cache itself (hash -> block map and the event log) is a policy
object: :class:`PrefixCache`, or :class:`NullPrefixCache` when prefix caching
is off, so no method here checks a flag.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from engine.kv_events import KVEvent, KVEventKind, KVSnapshot, Tier


class IntegrityError(AssertionError):
    """A pool or scheduler invariant does not hold: a bug, never bad input."""


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # set only while the block is in the prefix cache (a full block)
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    # links of the free queue (both None when not in it, or when alone in it)
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)

    def forget_hash(self) -> None:
        self.block_hash = self.parent_hash = self.token_ids = None


class FreeBlockQueue:
    """Doubly linked list of free blocks; the head is evicted / reused first.

    O(1) ``popleft``, ``append``, ``appendleft`` and ``remove`` from the middle
    (a cache hit on a free block).
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head: KVBlock | None = None
        self._tail: KVBlock | None = None
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def _assert_unlinked(self, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None and self._head is not block, \
            f"block {block.block_id} is already in the free queue"

    def append(self, block: KVBlock) -> None:
        self._assert_unlinked(block)
        block.prev_free = self._tail
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self._len += 1

    def appendleft(self, block: KVBlock) -> None:
        self._assert_unlinked(block)
        block.next_free = self._head
        if self._head is None:
            self._tail = block
        else:
            self._head.prev_free = block
        self._head = block
        self._len += 1

    def popleft(self) -> KVBlock:
        if self._head is None:
            raise IndexError("the free block queue is empty")
        block = self._head
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None:
            assert self._head is block, f"block {block.block_id} is not in the free queue"
            self._head = nxt
        else:
            prev.next_free = nxt
        if nxt is None:
            assert self._tail is block, f"block {block.block_id} is not in the free queue"
            self._tail = prev
        else:
            nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        """Head to tail; stops after len + 1 steps so a corrupt cycle cannot hang."""
        block, steps = self._head, 0
        while block is not None and steps <= self._len:
            yield block
            block, steps = block.next_free, steps + 1

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class PrefixCache:
    """Hash -> block map of cached full blocks, plus the KV event log."""

    def __init__(self, tier: Tier = Tier.DEVICE) -> None:
        self._by_hash: dict[int, KVBlock] = {}
        self._events: list[KVEvent] = []
        self._last_event_id = 0
        self._tier = tier

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._by_hash.get(block_hash)

    def store(self, blocks: Sequence[KVBlock], hashes: Sequence[int],
              token_chunks: Sequence[Sequence[int]], parent_hash: int) -> None:
        """Cache full blocks of one chain; one STORED event per contiguous run
        of newly stored blocks (a hash another block already holds is skipped)."""
        run: list[int] = []
        run_parent = prev = parent_hash
        for block, block_hash, tokens in zip(blocks, hashes, token_chunks, strict=True):
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            if block_hash in self._by_hash:
                self._emit_stored(run, run_parent)
                run, run_parent = [], block_hash
            else:
                block.block_hash, block.parent_hash, block.token_ids = block_hash, prev, tuple(tokens)
                self._by_hash[block_hash] = block
                run.append(block_hash)
            prev = block_hash
        self._emit_stored(run, run_parent)

    def evict(self, blocks: Sequence[KVBlock]) -> None:
        hashes = []
        for block in blocks:
            if block.block_hash is not None:
                hashes.append(block.block_hash)
                del self._by_hash[block.block_hash]
                block.forget_hash()
        if hashes:
            self._emit(KVEventKind.REMOVED, tuple(hashes))

    def clear(self) -> None:
        for block in self._by_hash.values():
            block.forget_hash()
        self._by_hash.clear()
        self._emit(KVEventKind.CLEARED)

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot(last_event_id=self._last_event_id, blocks={self._tier: tuple(self._by_hash)})

    def check(self, errors: list[str]) -> None:
        for block_hash, block in self._by_hash.items():
            if block.block_hash != block_hash:
                errors.append(f"hash {block_hash:#x} maps to block {block.block_id} "
                              f"carrying {block.block_hash}")

    def _emit_stored(self, hashes: list[int], parent_hash: int) -> None:
        if hashes:
            self._emit(KVEventKind.STORED, tuple(hashes), parent_hash)

    def _emit(self, kind: KVEventKind, hashes: tuple[int, ...] = (), parent: int | None = None) -> None:
        self._last_event_id += 1
        self._events.append(KVEvent(self._last_event_id, kind, hashes, parent, self._tier))


class NullPrefixCache(PrefixCache):
    """Prefix caching off: nothing is ever stored, so nothing hits or is evicted."""

    def lookup(self, block_hash: int) -> KVBlock | None:
        return None

    def store(self, blocks: Sequence[KVBlock], hashes: Sequence[int],
              token_chunks: Sequence[Sequence[int]], parent_hash: int) -> None:
        return None

    def clear(self) -> None:
        return None


class BlockPool:
    """All KV blocks of one node, the free queue and the prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}; give the KV pool more memory")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cache: PrefixCache = PrefixCache() if enable_caching else NullPrefixCache()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cache)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks from the queue head (ref_cnt 1), evicting cached ones."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks but only {self.num_free_blocks} are free; "
                             "check num_free_blocks before allocating")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        self.cache.evict(blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference (a cache hit or a fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass a request's blocks tail first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise IntegrityError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cache.lookup(block_hash)

    def cache_full_blocks(self, blocks: Sequence[KVBlock], hashes: Sequence[int],
                          token_chunks: Sequence[Sequence[int]], parent_hash: int) -> None:
        self.cache.store(blocks, hashes, token_chunks, parent_hash)

    def uncache(self, block: KVBlock) -> None:
        """Take one block out of the prefix cache (its owner will write into it)."""
        self.cache.evict([block])

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated, now private)."""
        self.cache.clear()

    def drain_events(self) -> list[KVEvent]:
        return self.cache.drain_events()

    def snapshot(self) -> KVSnapshot:
        return self.cache.snapshot()

    def check_integrity(self) -> None:
        errors: list[str] = []
        queued = self.free_queue.block_ids()
        if len(queued) != len(self.free_queue) or len(set(queued)) != len(queued):
            errors.append(f"free queue corrupt: len {len(self.free_queue)}, walked {queued}")
        queued_set = set(queued)
        used = [b for b in self.blocks if b.ref_cnt > 0]
        if len(queued_set) + len(used) != self.num_blocks:
            errors.append(f"free {len(queued_set)} + used {len(used)} != total {self.num_blocks}")
        for block in self.blocks:
            if block.ref_cnt < 0:
                errors.append(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if (block.ref_cnt == 0) != (block.block_id in queued_set):
                errors.append(f"block {block.block_id} ref_cnt {block.ref_cnt}, "
                              f"in free queue: {block.block_id in queued_set}")
            if block.block_hash is not None and self.cache.lookup(block.block_hash) is not block:
                errors.append(f"block {block.block_id} carries hash {block.block_hash:#x} "
                              "the prefix cache does not map to it")
        self.cache.check(errors)
        if errors:
            raise IntegrityError("block pool: " + "; ".join(errors))

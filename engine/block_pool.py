"""Physical KV blocks: the free queue in eviction order and the block pool.

A block with ``ref_cnt == 0`` sits in the free queue. If it also carries a
hash it is still in the prefix cache: a later request may *touch* it (cache
hit: out of the queue, ``ref_cnt`` 1) until allocation pops it from the
queue head and evicts it (a REMOVED event). Blocks without a hash are worth
nothing when free, so they go to the queue head and are reused first;
cached blocks go to the tail (least recently used is evicted first).

The prefix cache itself (hash -> block map) is a policy object:
:class:`PrefixCache`, or :class:`NullPrefixCache` when prefix caching is off,
so no method here checks a flag. Below the device sit the lower tiers
(:class:`engine.tiers.LowerTiers`, host then disk, possibly of size 0): an
evicted cached block moves down instead of vanishing, and a prefix hit there
is paged back into a fresh device block. Data moves are recorded in order in
``moves`` (a :class:`~engine.tiers.types.MoveLog`) and executed by the model
runner before the next forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from engine.kv_events import KVEvent, KVEventLog, KVSnapshot, Tier
from engine.prefix_cache import NullPrefixCache, PrefixCache
from engine.tiers.hierarchy import LowerTiers
from engine.tiers.types import MoveLog, TierEntry, TierSizes, cached

__all__ = ["BlockPool", "FreeBlockQueue", "IntegrityError", "KVBlock", "NullPrefixCache", "PrefixCache"]


class IntegrityError(AssertionError):
    """A pool or scheduler invariant does not hold: a bug, never bad input."""


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # set only while the block is in the prefix cache (a full block)
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: bytes | None = None     # packed uint32 (engine.block_hash.packed_tokens)
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

    def popleft_n(self, n: int) -> list[KVBlock]:
        """The first ``n`` blocks, unlinked in one walk (an allocation of many blocks)."""
        if n > self._len:
            raise IndexError(f"asked for {n} blocks from a free queue of {self._len}")
        out: list[KVBlock] = []
        block = self._head
        for _ in range(n):
            assert block is not None, "the free queue is shorter than its length"
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self._head = block
        if block is None:
            self._tail = None
        else:
            block.prev_free = None
        self._len -= n
        return out

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


class BlockPool:
    """All KV blocks of one node, the free queue, the prefix cache and the
    lower tiers."""

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 tier_sizes: TierSizes = TierSizes()) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}; give the KV pool more memory")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.events = KVEventLog()
        self.moves = MoveLog()
        self.cache: PrefixCache = (PrefixCache(Tier.DEVICE, self.events) if enable_caching
                                   else NullPrefixCache(Tier.DEVICE, self.events))
        self.lower = LowerTiers(tier_sizes, self.events, self.moves)

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
        """Pop ``n`` blocks from the queue head (ref_cnt 1); cached ones among
        them move down a tier (or are dropped when there is none)."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks but only {self.num_free_blocks} are free; "
                             "check num_free_blocks before allocating")
        blocks = self.free_queue.popleft_n(n)
        cached = []
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
            if block.block_hash is not None:
                cached.append(block)
        if cached:
            self.lower.demote(cached)
            self.cache.forget(cached)
        return blocks

    def page_in(self, entries: Sequence[TierEntry], keep: Sequence[bool]) -> list[KVBlock]:
        """Fresh device blocks (ref_cnt 1) for blocks found in a lower tier,
        with their moves recorded. A cached entry becomes a cached device block
        (STORED at DEVICE) unless ``keep``: then the lower tier keeps it and the
        device copy is private (its owner is about to write into it)."""
        self.lower.claim(entries)
        blocks = self.get_new_blocks(len(entries))
        self.lower.finish_page_in(entries, blocks, keep)
        run: list[tuple[KVBlock, TierEntry]] = []
        for entry, block, stay in zip(entries, blocks, keep):
            if entry.is_private or stay:
                continue
            if run and entry.parent_hash != run[-1][1].block_hash:
                self._store_run(run)
                run = []
            run.append((block, entry))
        self._store_run(run)
        return blocks

    def _store_run(self, run: list[tuple[KVBlock, TierEntry]]) -> None:
        if run:
            self.cache.store([b for b, _ in run], [cached(e.block_hash) for _, e in run],
                             [cached(e.token_ids) for _, e in run], run[0][1].parent_hash)

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

    def lookup_lower(self, block_hash: int) -> TierEntry | None:
        return self.lower.lookup(block_hash)

    def cache_full_blocks(self, blocks: Sequence[KVBlock], hashes: Sequence[int],
                          token_chunks: Sequence[bytes], parent_hash: int) -> None:
        self.cache.store(blocks, hashes, token_chunks, parent_hash)
        # the device holds these now (or already did): a lower copy is redundant
        if not self.lower.device_only:
            self.lower.discard([h for h in hashes if self.cache.lookup(h) is not None])

    def uncache(self, block: KVBlock) -> None:
        """Take one block out of the prefix cache (its owner will write into it)."""
        self.cache.evict([block])

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash in every tier (blocks in use stay
        allocated, now private; swapped-out blocks stay)."""
        self.cache.clear()
        self.lower.clear()

    def drain_events(self) -> list[KVEvent]:
        return self.events.drain()

    def snapshot(self) -> KVSnapshot:
        blocks = {Tier.DEVICE: self.cache.hashes(), **self.lower.snapshot_blocks()}
        return KVSnapshot(last_event_id=self.events.last_event_id, blocks=blocks)

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
        self.lower.check(errors, self.cache.hashes())
        if errors:
            raise IntegrityError("block pool: " + "; ".join(errors))

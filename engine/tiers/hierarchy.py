"""The lower tiers below the device: host DRAM, then disk.

Cached blocks evicted from the device move down instead of vanishing: into
the host tier, whose least recently used blocks move on to disk, whose least
recently used blocks are dropped (a REMOVED event). A block lives in exactly
one tier at a time (the router indexes each block at one tier): a page-in
moves it back to the device, and the device caching a block it computed
again discards any lower copy. Swapped-out blocks of preempted requests pin
host slots until the request resumes.

With both tiers sized 0 every evicted block is simply dropped (one REMOVED
event per eviction batch), which is the device-only behaviour: the null case
needs no flag.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from engine.kv_events import KVEventKind, KVEventLog, Tier
from engine.tiers.slot_tier import SlotTier
from engine.tiers.types import MoveLog, TierCounters, TierEntry, TierSizes, cached

if TYPE_CHECKING:
    from engine.block_pool import KVBlock


class LowerTiers:
    def __init__(self, sizes: TierSizes, log: KVEventLog, moves: MoveLog) -> None:
        self.sizes = sizes
        self.host = SlotTier(Tier.HOST, sizes.host_blocks)
        self.disk = SlotTier(Tier.DISK, sizes.disk_blocks)
        self.levels = (self.host, self.disk)
        # both tiers sized 0 (the device-only default): evictions are dropped at once,
        # without entries built and pushed through two empty levels (hot in the simulator)
        self.device_only = sizes.host_blocks == 0 and sizes.disk_blocks == 0
        self.log = log
        self.moves = moves
        self._counts = dict(page_outs=0, page_ins=0, dropped=0, swap_out_blocks=0, swap_in_blocks=0)

    def level(self, tier: Tier) -> SlotTier:
        return self.host if tier is Tier.HOST else self.disk

    @property
    def counters(self) -> TierCounters:
        return TierCounters(**self._counts)

    # ---- lookup --------------------------------------------------------------
    def lookup(self, block_hash: int) -> TierEntry | None:
        if self.device_only:
            return None
        for level in self.levels:
            entry = level.lookup(block_hash)
            if entry is not None:
                return entry
        return None

    # ---- moving down ---------------------------------------------------------
    def demote(self, blocks: Sequence[KVBlock]) -> None:
        """The device evicts these cached blocks (oldest first): move them down."""
        if self.device_only:
            if blocks:
                self._counts["dropped"] += len(blocks)
                self.log.emit(KVEventKind.REMOVED, tuple(cached(b.block_hash) for b in blocks), tier=Tier.DEVICE)
            return
        entries = [TierEntry(Tier.DEVICE, b.block_id, b.block_hash, b.parent_hash, b.token_ids)
                   for b in blocks]
        self._push(0, entries)

    def _push(self, depth: int, entries: list[TierEntry]) -> None:
        """Store ``entries`` (oldest first, each at its current place) into
        ``levels[depth:]``; what fits nowhere is dropped."""
        if not entries:
            return
        if depth == len(self.levels):
            self._counts["dropped"] += len(entries)
            self.log.emit(KVEventKind.REMOVED, tuple(cached(e.block_hash) for e in entries), tier=entries[0].tier)
            return
        level = self.levels[depth]
        fit = min(len(entries), level.room)
        skip, keep = entries[:len(entries) - fit], entries[len(entries) - fit:]
        num_evict = max(0, len(keep) - level.num_free)
        slots = [level.pop_free() for _ in range(len(keep) - num_evict)]
        victims = [level.pop_lru() for _ in range(num_evict)]
        # victims are older than what arrives now; their moves out are recorded
        # before anything is written into their slots
        self._push(depth + 1, victims + skip)
        slots += [v.slot for v in victims]
        for entry, slot in zip(keep, slots):
            self.moves.add(entry.tier, entry.slot, level.tier, slot)
            level.insert(TierEntry(level.tier, slot, entry.block_hash, entry.parent_hash, entry.token_ids))
        self._counts["page_outs"] += len(keep)
        self.log.stored_chains([cached(e.block_hash) for e in keep], [e.parent_hash for e in keep], level.tier)

    def discard(self, hashes: Sequence[int]) -> None:
        """The device now caches these hashes: drop lower copies (no event: the
        device's STORED event already moved the router's entry)."""
        for h in hashes:
            for level in self.levels:
                if level.discard(h):
                    break

    def clear(self) -> None:
        for level in self.levels:
            level.clear()

    # ---- moving up -----------------------------------------------------------
    def claim(self, entries: Sequence[TierEntry]) -> None:
        for entry in entries:
            self.level(entry.tier).claim(entry)

    def finish_page_in(self, entries: Sequence[TierEntry], blocks: Sequence[KVBlock],
                       keep: Sequence[bool]) -> None:
        """Record the moves of claimed entries into fresh device blocks, then
        free their slots (or keep a copy where ``keep``)."""
        for entry, block, stay in zip(entries, blocks, keep, strict=True):
            self.moves.add(entry.tier, entry.slot, Tier.DEVICE, block.block_id)
            level = self.level(entry.tier)
            if stay and not entry.is_private:
                level.restore(entry)
            else:
                level.release(entry)
            self._counts["swap_in_blocks" if entry.is_private else "page_ins"] += 1

    # ---- swap ----------------------------------------------------------------
    def swap_out(self, blocks: Sequence[KVBlock]) -> tuple[int, ...] | None:
        """Copy a preempted request's blocks to pinned host slots, evicting
        cached host blocks (down to disk) for room. None when the host tier
        cannot hold them (then nothing changed)."""
        host = self.host
        if not blocks or host.room < len(blocks):
            return None
        num_evict = max(0, len(blocks) - host.num_free)
        slots = [host.pop_free() for _ in range(len(blocks) - num_evict)]
        victims = [host.pop_lru() for _ in range(num_evict)]
        self._push(1, victims)
        slots += [v.slot for v in victims]
        for block, slot in zip(blocks, slots):
            host.pin(slot)
            self.moves.add(Tier.DEVICE, block.block_id, Tier.HOST, slot)
        self._counts["swap_out_blocks"] += len(blocks)
        return tuple(slots)

    def release_swap(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.host.unpin(slot)

    # ---- state ---------------------------------------------------------------
    def snapshot_blocks(self) -> dict[Tier, tuple[int, ...]]:
        return {level.tier: level.hashes() for level in self.levels}

    def check(self, errors: list[str], device_hashes: Sequence[int]) -> None:
        seen = set(device_hashes)
        for level in self.levels:
            level.check(errors)
            both = seen.intersection(level.hashes())
            if both:
                errors.append(f"hashes {sorted(both)} are held in {level.tier.value} and a faster tier")
            seen.update(level.hashes())

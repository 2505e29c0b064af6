"""KV cache manager: block tables of requests over the block pool.

Automatic prefix caching: a request's chained block hashes
(:func:`engine.block_hash.block_hashes`) find the longest cached prefix of
full blocks; every hit is confirmed by comparing the block's tokens and
parent hash, so a hash collision never serves the wrong KV. Only full,
computed blocks enter the cache; a partial last block stays private.

A request only ever writes into *private* blocks (ref_cnt 1, not cached).
Before a write into a shared block the manager copies it (copy-on-write: a
``(src, dst)`` pair the runner copies before the forward); a cached block
held by this request alone is simply taken out of the cache.

Tiers (engine/tiers/): a prefix hit may also be found in the host or disk
tier; admission then pages those blocks into fresh device blocks. A request
preempted by swap keeps its blocks in pinned host slots (a
:class:`~engine.tiers.SwapRecord`) and resumes from them. Every data movement,
copy-on-write copies included, is one ordered move log: ``take_kv_moves()``.
"""
from __future__ import annotations

from engine.block_hash import packed_block_hashes, packed_tokens, root_hash
from engine.block_pool import BlockPool, IntegrityError, KVBlock
from engine.kv_events import KVEvent, KVSnapshot, Tier
from engine.kv_lookup import ComputedBlocks, PrefixCacheStats, ResumedBlocks
from engine.request import Request
from engine.tiers.types import KVMove, SwapRecord, TierCounters, TierEntry, TierSizes

__all__ = ["ComputedBlocks", "KVCacheManager", "PrefixCacheStats", "ResumedBlocks", "cdiv"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def packed_slice(request: Request, lo: int, hi: int) -> bytes:
    """Tokens ``lo:hi`` of prompt + output, packed (``packed_tokens``) without
    joining the two lists; the prompt's part is cut from ``request.prompt_packed``
    (packed once per request, on first use)."""
    prompt = _prompt_packed(request)
    p = request.num_prompt_tokens
    if hi <= p:
        return prompt[lo * 4:hi * 4]
    out = request.output_token_ids
    if lo >= p:
        return packed_tokens(out[lo - p:hi - p])
    return prompt[lo * 4:] + packed_tokens(out[:hi - p])


def packed_blocks(request: Request, first: int, end: int, block_size: int) -> list[bytes]:
    """Blocks ``first:end`` of prompt + output, each packed (``packed_tokens``).
    Prompt blocks come from ``prompt_blocks``: the same bytes objects every
    time, so caching a block copies nothing."""
    prompt = prompt_blocks(request, block_size)
    in_prompt = min(end, len(prompt))
    chunks = list(prompt[first:in_prompt])
    if end > in_prompt:
        lo, step = max(first, in_prompt), block_size * 4
        rest = packed_slice(request, lo * block_size, end * block_size)
        chunks += [rest[i * step:(i + 1) * step] for i in range(end - lo)]
    return chunks


def prompt_blocks(request: Request, block_size: int) -> tuple[bytes, ...]:
    """``request.prompt_blocks``, cut from the packed prompt on first use."""
    blocks = request.prompt_blocks
    n = request.num_prompt_tokens // block_size
    if blocks is None:
        blocks = request.prompt_blocks = cut_blocks(_prompt_packed(request), block_size)
    elif len(blocks) != n or (n and len(blocks[0]) != block_size * 4):
        raise ValueError(f"request {request.request_id!r}: prompt_blocks holds {len(blocks)} block(s) "
                         f"of {len(blocks[0]) // 4 if blocks else 0} tokens; this KV manager's blocks "
                         f"hold {block_size} tokens ({n} full blocks in the prompt): cut the packed "
                         "prompt at the engine's block size, or leave it None")
    return blocks


def cut_blocks(packed: bytes, block_size: int) -> tuple[bytes, ...]:
    """Packed tokens cut into their full blocks (a trailing partial block is left out)."""
    step = block_size * 4
    return tuple(packed[i:i + step] for i in range(0, len(packed) - step + 1, step))


def _prompt_packed(request: Request) -> bytes:
    prompt = request.prompt_packed
    if prompt is None:
        prompt = request.prompt_packed = packed_tokens(request.prompt_token_ids)
    return prompt


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 tier_sizes: TierSizes = TierSizes(), kv_cache_dtype: str = "auto") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype      # folded into the root hash (engine/block_hash.py)
        self.pool = BlockPool(num_blocks, enable_caching, tier_sizes)
        self._tables: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}   # leading blocks of each table already offered to the cache
        self._ids: dict[str, list[int]] = {}     # block ids of a table, dropped whenever the table changes
        self._swapped: dict[str, SwapRecord] = {}
        self._moves = self.pool.moves
        self._stats = PrefixCacheStats()

    # ---- prefix cache lookup -------------------------------------------------

    def get_computed_blocks(self, request: Request, max_tokens: int | None = None) -> ComputedBlocks:
        """Longest cached prefix of full blocks, covering at most ``max_tokens``
        tokens (default ``num_tokens - 1``: at least one token is computed so
        its logits can be sampled). Does not take references."""
        swapped = self._swapped.get(request.request_id)
        if swapped is not None:
            entries = tuple(TierEntry(Tier.HOST, slot) for slot in swapped.slots)
            return ResumedBlocks(entries, swapped.num_tokens)
        limit = request.num_tokens - 1 if max_tokens is None else min(max_tokens, request.num_tokens)
        self.update_block_hashes(request)
        bs, hits = self.block_size, []
        parent = root_hash(request.cache_salt, self.kv_cache_dtype)
        prompt = prompt_blocks(request, bs)
        for i, block_hash in enumerate(request.block_hashes):
            if i * bs >= limit:
                break
            block = self.pool.lookup(block_hash) or self.pool.lookup_lower(block_hash)
            if block is None or block.parent_hash != parent:
                break
            tokens = prompt[i] if i < len(prompt) else packed_slice(request, i * bs, (i + 1) * bs)
            if block.token_ids != tokens:
                break
            hits.append(block)
            parent = block_hash
        return ComputedBlocks(tuple(hits), min(len(hits) * bs, max(limit, 0)))

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to every full block of its tokens."""
        have, bs = len(request.block_hashes), self.block_size
        n_full = request.num_tokens // bs
        if have < n_full:
            parent = request.block_hashes[-1] if have else root_hash(request.cache_salt, self.kv_cache_dtype)
            # only the new blocks' tokens, without joining prompt and output (hot on every decode step)
            request.block_hashes.extend(packed_block_hashes(packed_slice(request, have * bs, n_full * bs), bs, parent))

    # ---- allocation ----------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: ComputedBlocks | None = None) -> list[int] | None:
        """Make the table hold ``start + num_new_tokens`` tokens, where start is
        ``computed_blocks.num_computed_tokens`` for a request being admitted with a
        prefix hit (it must own no blocks yet) or ``request.num_computed_tokens``.
        Returns the whole block table, or None (nothing changed) when the pool
        is short of free blocks."""
        rid = request.request_id
        if computed_blocks is None and num_new_tokens > 0:
            # fast path (every decode step): the table already holds the new tokens and the
            # blocks they are written into are private and not cached, so nothing changes
            table = self._tables.get(rid)
            if table is not None:
                start, bs = request.num_computed_tokens, self.block_size
                first, end = start // bs, (start + num_new_tokens + bs - 1) // bs
                if end <= len(table):
                    if end - first == 1:        # one block written (a decode step): no generator
                        b = table[first]
                        untouched = b.ref_cnt == 1 and b.block_hash is None
                    else:
                        untouched = all(table[i].ref_cnt == 1 and table[i].block_hash is None
                                        for i in range(first, end))
                    if untouched:
                        return self._block_ids(rid, table)
        prefix: list[KVBlock | TierEntry] | list[KVBlock]     # hits may sit in a lower tier
        if computed_blocks is not None:
            assert not self._tables.get(rid), f"request {rid} already owns blocks"
            start, prefix = computed_blocks.num_computed_tokens, list(computed_blocks.blocks)
            extra_ref = 1        # admission takes a reference to each hit block
        else:
            start, prefix = request.num_computed_tokens, self._tables.get(rid, [])
            extra_ref = 0
        num_required = cdiv(start + num_new_tokens, self.block_size)
        written = range(start // self.block_size, min(len(prefix), num_required) if num_new_tokens else 0)
        if computed_blocks is not None:
            lower = [i for i, b in enumerate(prefix) if isinstance(b, TierEntry)]
            taken_from_free = sum(1 for b in prefix if isinstance(b, KVBlock) and b.ref_cnt == 0)
        else:   # a table this manager owns holds device blocks only (hits were paged in at admission)
            lower, taken_from_free = [], 0
        to_copy = [i for i in written if isinstance(blk := prefix[i], KVBlock) and blk.ref_cnt + extra_ref > 1]
        num_new = max(0, num_required - len(prefix)) + len(to_copy) + len(lower)
        if num_new > self.pool.num_free_blocks - taken_from_free:
            return None
        if computed_blocks is not None:
            self._admit(request, computed_blocks, prefix, lower, written)
            num_new -= len(lower)
        table = self._tables.setdefault(rid, [])
        self._num_cached.setdefault(rid, 0)
        fresh = self.pool.get_new_blocks(num_new)
        for i in written:
            self._make_writable(rid, table, i, fresh)
        table.extend(fresh)
        self._ids.pop(rid, None)
        return self._block_ids(rid, table)

    def _block_ids(self, rid: str, table: list[KVBlock]) -> list[int]:
        """The table's block ids, built once per change of the table (not on every
        decode step); the list is shared with earlier callers, who must not modify it."""
        ids = self._ids.get(rid)
        if ids is None:
            ids = self._ids[rid] = [b.block_id for b in table]
        return ids

    def _admit(self, request: Request, computed: ComputedBlocks, prefix: list, lower: list[int],
               written: range) -> None:
        """Take the hits: a reference to each device hit, fresh device blocks
        for lower-tier hits (paged in; a swapped request's blocks come back)."""
        rid = request.request_id
        self.pool.touch(b for b in prefix if isinstance(b, KVBlock))
        if lower:
            paged = self.pool.page_in([prefix[i] for i in lower], [i in written for i in lower])
            for i, block in zip(lower, paged):
                prefix[i] = block
        self._tables[rid] = prefix
        self._ids.pop(rid, None)
        self._num_cached[rid] = next((i for i, b in enumerate(prefix) if b.block_hash is None), len(prefix))
        if isinstance(computed, ResumedBlocks):
            self._swapped.pop(rid)
        else:
            self._stats = PrefixCacheStats(self._stats.queried_tokens + request.num_tokens,
                                           self._stats.hit_tokens + computed.num_computed_tokens)

    def _make_writable(self, rid: str, table: list[KVBlock], i: int, fresh: list[KVBlock]) -> None:
        block = table[i]
        if block.ref_cnt > 1:
            dst = fresh.pop()
            self._moves.add(Tier.DEVICE, block.block_id, Tier.DEVICE, dst.block_id)
            table[i] = dst
            self.pool.free_blocks([block])
        elif block.block_hash is not None:
            self.pool.uncache(block)
        else:
            return
        self._num_cached[rid] = min(self._num_cached[rid], i)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write pairs ``(src, dst)`` made since the last call. Takes the
        whole move log: with lower tiers in use call :meth:`take_kv_moves`."""
        return [(m.src, m.dst) for m in self._moves.take() if m.is_copy]

    def take_kv_moves(self) -> list[KVMove]:
        """Every block move decided since the last call, in order (copy-on-write
        copies, page-outs, page-ins, swaps); run them before the next forward."""
        return self._moves.take()

    def fork(self, parent: Request, child: Request, num_tokens: int | None = None) -> list[int]:
        """Child shares the parent's blocks covering ``num_tokens`` tokens
        (default ``child.num_computed_tokens``), partial last block included."""
        n = child.num_computed_tokens if num_tokens is None else num_tokens
        assert child.request_id not in self._tables, f"request {child.request_id} already owns blocks"
        shared = self._tables.get(parent.request_id, [])[:cdiv(n, self.block_size)]
        self.pool.touch(shared)
        self._tables[child.request_id] = list(shared)
        self._ids.pop(child.request_id, None)
        self._num_cached[child.request_id] = min(self._num_cached.get(parent.request_id, 0), len(shared))
        n_hashes = min(len(parent.block_hashes), n // self.block_size)
        child.block_hashes[:] = parent.block_hashes[:n_hashes]
        return [b.block_id for b in shared]

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first (the tail is evicted first),
        and its swapped-out blocks if it has any."""
        table = self._tables.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self._ids.pop(request.request_id, None)
        self._moves.drop_copies_into({b.block_id for b in table})
        self.pool.free_blocks(reversed(table))
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None:
            self.pool.lower.release_swap(swapped.slots)

    def swap_out(self, request: Request) -> bool:
        """Preempt by swap: copy the blocks holding the request's computed
        tokens to pinned host slots and free its device blocks. False (nothing
        changed) when there is nothing to keep or the host tier has no room."""
        rid = request.request_id
        table = self._tables.get(rid, [])
        keep = cdiv(request.num_computed_tokens, self.block_size)
        slots = self.pool.lower.swap_out(table[:keep]) if keep else None
        if slots is None:
            return False
        self._swapped[rid] = SwapRecord(slots, request.num_computed_tokens)
        del self._tables[rid], self._num_cached[rid]
        self._ids.pop(rid, None)
        # pending copies into these blocks stay: the swap-out reads them after
        self.pool.free_blocks(reversed(table))
        return True

    def swapped_ids(self) -> set[str]:
        return set(self._swapped)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the full blocks among the first ``num_tokens`` (computed)
        tokens to the prefix cache; the partial last block stays private."""
        rid = request.request_id
        start, end = self._num_cached.get(rid, 0), num_tokens // self.block_size
        if end <= start:
            return
        self.update_block_hashes(request)
        table = self._tables[rid]
        assert len(table) >= end, f"request {rid}: caching {end} blocks of a {len(table)}-block table"
        bs = self.block_size
        parent = request.block_hashes[start - 1] if start else root_hash(request.cache_salt, self.kv_cache_dtype)
        self.pool.cache_full_blocks(table[start:end], request.block_hashes[start:end],
                                    packed_blocks(request, start, end, bs), parent)
        self._num_cached[rid] = end

    # ---- queries -------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, [])]

    def owners(self) -> set[str]:
        """Ids of requests that own blocks."""
        return set(self._tables)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._stats

    @property
    def tier_counters(self) -> TierCounters:
        return self.pool.lower.counters

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use stay allocated, now private."""
        self.pool.reset_prefix_cache()

    def drain_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

    def snapshot(self) -> KVSnapshot:
        return self.pool.snapshot()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        errors = []
        for rid, table in self._tables.items():
            if not all(isinstance(b, KVBlock) for b in table):
                errors.append(f"request {rid}'s table holds a non-device entry (allocate_slots relies on "
                              "device blocks only)")
                continue
            if len({b.block_id for b in table}) != len(table):
                errors.append(f"request {rid} holds a block twice: {[b.block_id for b in table]}")
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
            if rid in self._ids and self._ids[rid] != [b.block_id for b in table]:
                errors.append(f"request {rid}'s remembered block ids {self._ids[rid]} are not its table's")
        for rid in self._ids.keys() - self._tables.keys():
            errors.append(f"block ids are remembered for {rid}, which owns no table")
        for block in self.pool.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                errors.append(f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                              f"{refs.get(block.block_id, 0)} tables hold it")
        swap_slots = [s for record in self._swapped.values() for s in record.slots]
        if sorted(swap_slots) != sorted(self.pool.lower.host.pinned_slots()):
            errors.append(f"swap records hold host slots {sorted(swap_slots)} but the host tier pins "
                          f"{sorted(self.pool.lower.host.pinned_slots())}")
        for rid in self._swapped.keys() & self._tables.keys():
            errors.append(f"request {rid} is swapped out and owns device blocks")
        if errors:
            raise IntegrityError("kv cache manager: " + "; ".join(errors))

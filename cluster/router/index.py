"""`PrefixIndex`: which worker holds which prompt prefix, fed by KV events.

Block hashes are chained (engine/block_hash.py), so one hash names a whole
prefix and the index can be flat: one dict ``hash -> packed worker masks``.
The packed value holds three lanes of ``lane`` bits (worker i is bit i of
each): workers holding the block in any tier, those holding it off device
(host or disk), and those holding it on disk. Lanes widen (a one-off
re-encode) when more workers than ``lane`` bits have been seen.

Matching a prompt need not read every block. A worker's match is its
leading run of the prompt's blocks; when each worker's blocks along the
prompt form a prefix of it ("prefix closed"), where each group of workers
stops is found by binary search: O(log n) lookups in the big map per group
(``_segments``), not one per block. Closure is what eviction keeps in
practice (a parent is touched whenever its child is, so it goes last) but
not always (a block evicted from under its children, a tier dropping a
block its child outlives), so the index tracks where it may fail, per
worker, from the parents STORED events carry (a run of blocks chaining from
``parent_hash``, engine/kv_events.py):

- ``_parent``: each indexed block's parent, as the first event that stored
  it (with a parent) said; ``_Worker.kids``: per parent hash, how many of
  its children the worker holds;
- a worker is *risky* at block h when it holds children of h but not h (a
  hole), or holds h without a known parent (a snapshot, or an event with
  ``parent_hash=None``: the producer did not say how its blocks chain);
- ``_special``: hash -> (off-device lane, disk lane, risky lane) for every
  block someone holds off device or is risky at; small next to ``_held``.

A match then reads ``_special`` over the blocks some worker matched (C
speed): if no worker holding the first block is risky at a later one, every
one of them holds a prefix of the prompt there (a worker skipping block k
would be risky at k or at the first block it holds after k), so the search
was right, and the off-device blocks are counted per group. Otherwise it
reads every block (``_walk``). Both answer the same (tests compare them with
a plain scan); trusting a STORED run's chaining is the event protocol's
contract (the engine's ``stored_chains``).

Where the router's C tables build (native.py) and lanes are 64 bits (up to
64 workers ever seen), ``_held`` is mirrored in a flat table after every
event and ``match`` is ``_walk`` in C: every prompt block probed in one call,
prefetches running ahead so the cache misses overlap (the dict walk was
memory latency: a few dependent misses per lookup). The search above serves
otherwise; tests compare all three with a plain scan.

Event protocol (engine/kv_events.py), per worker:

- ids are consecutive, a fresh worker's first event has id ``first_event_id``
  (default 1, so a fresh worker's snapshot says ``last_event_id=0``); an id at
  or below the last applied one is a duplicate and skipped; an id above the
  next expected one is a gap: the worker is marked as needing a resync and its
  events are dropped until ``resync(worker_id, snapshot)``;
- STORED adds blocks at the event's tier; a block already indexed moves to
  that tier (a worker reports each block at the fastest tier holding it, so
  a demotion device -> host is a STORED at HOST); ``parent_hash`` is the
  parent of its first block, each later block's parent the one before it;
- REMOVED drops blocks from every tier; CLEARED drops all of the worker's.

``remove_worker`` forgets a dead worker until it reports again (from
``first_event_id``, or through a resync).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from collections import Counter
from functools import reduce
from itertools import islice
from operator import or_
from typing import Iterable, Iterator, Mapping, Sequence, TypeVar, overload

from cluster.router import native
from engine.kv_events import KVEvent, KVEventKind, KVSnapshot, Tier

_T = TypeVar("_T")

_RESYNC_ORDER = (Tier.DISK, Tier.HOST, Tier.DEVICE)   # last write wins: the fastest tier
_HINTS = 1 << 17                                        # match-length hints kept (cleared whole when full)


@dataclass(frozen=True, slots=True)
class MatchInfo:
    """Leading prompt blocks one worker holds, by the tier holding them."""
    device_blocks: int
    host_blocks: int = 0
    disk_blocks: int = 0
    in_flight_blocks: int = 0    # beyond the indexed ones: sent there, not yet reported (inflight.py)

    @property
    def blocks(self) -> int:
        return self.device_blocks + self.host_blocks + self.disk_blocks + self.in_flight_blocks


class Matches(Mapping[str, MatchInfo]):
    """What ``PrefixIndex.match`` found: worker id -> MatchInfo, kept as groups.

    ``groups`` lists ``(mask, info)``: every worker whose index bit is set in
    ``mask`` matches ``info`` (a later group overrides an earlier one for the
    same worker). The index emits one group per match length, so a prompt
    whose first block every worker holds is a handful of groups, not a dict of
    every worker; a policy can cost a group in one array operation
    (cluster/router/cost_vector.py). Workers without an index bit (none of
    their events applied yet) can only be set, and are kept in ``extra``.
    Reads as an ordinary mapping; it materialises a dict only when iterated.
    """
    __slots__ = ("groups", "extra", "_ids", "_bits", "_dict")

    def __init__(self, ids: Sequence[str], bits: Mapping[str, int]) -> None:
        self.groups: list[tuple[int, MatchInfo]] = []
        self.extra: dict[str, MatchInfo] = {}
        self._ids, self._bits = ids, bits       # the index's bit -> worker id, worker id -> bit
        self._dict: dict[str, MatchInfo] | None = None

    @property
    def ids(self) -> Sequence[str]:
        """The index's bit -> worker id list (read-only by convention)."""
        return self._ids

    def add(self, mask: int, info: MatchInfo) -> None:
        """Every worker in ``mask`` matches ``info``."""
        if mask:
            self.groups.append((mask, info))
            self._dict = None

    def __setitem__(self, worker_id: str, info: MatchInfo) -> None:
        bit = self._bits.get(worker_id)
        if bit is None:
            self.extra[worker_id] = info
        else:
            self.groups.append((1 << bit, info))
        self._dict = None

    @overload
    def get(self, worker_id: str, /) -> MatchInfo | None: ...
    @overload
    def get(self, worker_id: str, default: MatchInfo, /) -> MatchInfo: ...
    @overload
    def get(self, worker_id: str, default: _T, /) -> MatchInfo | _T: ...

    def get(self, worker_id: str, default: object = None, /) -> object:
        info = self.extra.get(worker_id)
        if info is not None:
            return info
        bit = self._bits.get(worker_id)
        if bit is not None:
            for mask, info in reversed(self.groups):
                if mask >> bit & 1:
                    return info
        return default

    def __getitem__(self, worker_id: str) -> MatchInfo:
        info = self.get(worker_id)
        if info is None:
            raise KeyError(worker_id)
        return info

    def __contains__(self, worker_id: object) -> bool:
        return isinstance(worker_id, str) and self.get(worker_id) is not None

    def as_dict(self) -> dict[str, MatchInfo]:
        if self._dict is None:
            out, ids = {}, self._ids
            for mask, info in self.groups:
                while mask:
                    low = mask & -mask
                    mask ^= low
                    out[ids[low.bit_length() - 1]] = info
            out.update(self.extra)
            self._dict = out
        return self._dict

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self.as_dict() == dict(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Matches({self.as_dict()!r})"


@dataclass(frozen=True, slots=True)
class ApplyResult:
    applied: int                            # events applied to the index
    duplicates: int = 0                     # events at or below the last applied id, skipped
    needs_resync: bool = False              # fetch a KVSnapshot and call resync()
    expected_event_id: int | None = None    # on a gap: the id that was due
    received_event_id: int | None = None    # on a gap: the id that came


class _Worker:
    """Internal per-worker state (mutable, never handed out)."""
    __slots__ = ("index", "bit", "blocks", "kids", "unparented", "next_event_id", "needs_resync",
                 "set_bits", "keep_bits")

    def __init__(self, index: int, next_event_id: int, lane: int) -> None:
        self.index = index
        self.bit = 1 << index
        self.blocks: dict[int, Tier] = {}
        self.kids: dict[int, int] = {}           # parent hash -> blocks held here whose parent it is
        self.unparented: set[int] = set()        # held blocks stored without a known parent
        self.next_event_id = next_event_id
        self.needs_resync = False
        self.set_lane(lane)

    def set_lane(self, lane: int) -> None:
        """Packed bits this worker contributes per tier, for a lane width."""
        bit = 1 << self.index
        self.set_bits = {Tier.DEVICE: bit, Tier.HOST: bit | bit << lane,
                         Tier.DISK: bit | bit << lane | bit << 2 * lane}
        self.keep_bits = {t: ~b for t, b in self.set_bits.items()}


class PrefixIndex:
    def __init__(self, first_event_id: int = 1, *, use_native: bool = True) -> None:
        """``use_native``: match through the C table (native.py) where it builds; False:
        the pure-Python search (``_segments`` / ``_walk``), as on a host without it."""
        self._first_event_id = first_event_id
        self._lane = 64                          # bits per lane in a packed value
        self._held: dict[int, int] = {}        # hash -> packed masks (see module doc)
        self._parent: dict[int, int] = {}      # hash -> its parent's hash, as a STORED event gave it
        self._risky: dict[int, int] = {}       # hash -> workers that may skip it (see module doc)
        self._special: dict[int, int] = {}     # hash -> off-device, disk and risky lanes; 0 is absent
        self._workers: dict[str, _Worker] = {}
        self._indices: dict[str, int] = {}     # worker id -> bit index, kept across removal
        self._ids: list[str] = []              # bit index -> worker id
        self._match_cache: list[MatchInfo] = []  # MatchInfo(k) for device-only matches
        self._hints: dict[int, int] = {}       # block -> length of the match last found from it (a guess)
        # _held's lanes in a flat C table (native.py), kept in step per event; None: pure Python
        self._native = native.block_table() if use_native else None

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
            self._store(w, snapshot.blocks.get(tier, ()), tier, None)
        w.next_event_id = snapshot.last_event_id + 1
        w.needs_resync = False

    def remove_worker(self, worker_id: str) -> None:
        """Forget a dead worker's blocks until it reports again. Idempotent."""
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._drop_all(w)

    def _apply_one(self, w: _Worker, ev: KVEvent) -> None:
        if ev.kind is KVEventKind.STORED:
            self._store(w, ev.block_hashes, ev.tier, ev.parent_hash)
            if (self._native is None and ev.parent_hash is not None and ev.block_hashes
                    and ev.block_hashes[0] not in self._hints):
                self._hint(ev.block_hashes[0], len(ev.block_hashes))   # a run: a match may end with it
        elif ev.kind is KVEventKind.REMOVED:
            self._remove(w, ev.block_hashes)
        elif ev.kind is KVEventKind.CLEARED:
            self._drop_all(w)
        else:
            raise ValueError(f"unknown KV event kind {ev.kind!r}: use KVEventKind.STORED, "
                             "REMOVED or CLEARED")

    def _store(self, w: _Worker, hashes: Sequence[int], tier: Tier, parent: int | None) -> None:
        """``parent`` given: the blocks chain from it (the event protocol); None: their
        parents are unknown (a snapshot, or a producer that does not say)."""
        if not isinstance(tier, Tier):
            raise ValueError(f"unknown tier {tier!r}: use engine.kv_events.Tier")
        held, blocks, add, keep = self._held, w.blocks, w.set_bits[tier], w.keep_bits
        special, parents, kids = self._special, self._parent, w.kids
        off = add >> self._lane != 0
        for h in hashes:
            prev = blocks.get(h)
            if prev is not tier:
                blocks[h] = tier
                v = held.get(h, 0)
                if prev is not None:
                    v &= keep[prev]
                held[h] = v | add
                if prev is None:
                    if parent is None or h in kids:
                        self._link(w, h, parent)
                    else:                         # _link's common case, inline
                        q = parents.setdefault(h, parent)
                        n = kids.get(q, 0)
                        kids[q] = n + 1
                        if not n and q not in blocks:
                            self._flag(q, w.bit, True)
                if off or h in special:           # (a risky block is in special too)
                    self._mark(h)
            if parent is not None:
                parent = h
        self._mirror(hashes)

    def _remove(self, w: _Worker, hashes: Sequence[int]) -> None:
        held, blocks, keep = self._held, w.blocks, w.keep_bits
        special, parents, kids, unparented = self._special, self._parent, w.kids, w.unparented
        for h in hashes:
            prev = blocks.pop(h, None)
            if prev is None:
                continue
            v = held[h] & keep[prev]
            if h in unparented or h in kids:
                self._unlink(w, h)
            else:                                 # _unlink's common case, inline
                q = parents[h]
                n = kids[q] - 1
                if n:
                    kids[q] = n
                else:
                    del kids[q]
                    if q not in blocks:
                        self._flag(q, w.bit, False)
            if v:
                held[h] = v
            else:
                del held[h]
                parents.pop(h, None)
            if h in special:
                self._mark(h)
        self._mirror(hashes)

    def _mirror(self, hashes: Sequence[int]) -> None:
        """Copy these blocks' packed masks to the C table (a hash that is not a
        64-bit unsigned int, or no memory to grow it, turns the table off for
        good: the Python paths serve)."""
        if self._native is not None:
            try:
                self._native.sync(hashes, self._held)
            except (OverflowError, TypeError, ValueError, MemoryError):
                self._native = None

    def _drop_all(self, w: _Worker) -> None:
        self._remove(w, list(w.blocks))

    # ---- chain shape: what lets match() binary-search (module doc) -------
    def _link(self, w: _Worker, h: int, parent: int | None) -> None:
        """``w`` now holds ``h`` (it did not before); ``parent``: as the event gave it."""
        q = self._parent.setdefault(h, parent) if parent is not None else self._parent.get(h)
        if h in w.kids:                          # w held children of h, not h: no longer a hole
            self._flag(h, w.bit, False)
        if q is None:
            w.unparented.add(h)
            self._flag(h, w.bit, True)
            return
        n = w.kids.get(q, 0)
        w.kids[q] = n + 1
        if not n and q not in w.blocks:          # w holds a child of q but not q: a hole
            self._flag(q, w.bit, True)

    def _unlink(self, w: _Worker, h: int) -> None:
        """``w`` dropped ``h`` (``self._parent`` still has it)."""
        if h in w.unparented:
            w.unparented.discard(h)
            self._flag(h, w.bit, False)
        else:
            q = self._parent[h]
            n = w.kids[q] - 1
            if n:
                w.kids[q] = n
            else:
                del w.kids[q]
                if q not in w.blocks:
                    self._flag(q, w.bit, False)
        if h in w.kids:                          # w still holds children of h: a hole
            self._flag(h, w.bit, True)

    def _flag(self, h: int, bit: int, on: bool) -> None:
        risky = self._risky
        v = risky.get(h, 0)
        v = v | bit if on else v & ~bit
        if v:
            risky[h] = v
        else:
            risky.pop(h, None)
        self._mark(h)

    def _mark(self, h: int) -> None:
        """Recompute ``h``'s entry in ``self._special`` from its packed masks and risky bits."""
        lane = self._lane
        v = self._held.get(h, 0) >> lane | self._risky.get(h, 0) << 2 * lane
        if v:
            self._special[h] = v
        else:
            self._special.pop(h, None)

    def _worker(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            if not isinstance(worker_id, str) or not worker_id:
                raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")
            index = self._indices.get(worker_id)
            if index is None:
                index = self._indices[worker_id] = len(self._ids)
                self._ids.append(worker_id)
                if index >= self._lane:
                    self._widen()
            w = self._workers[worker_id] = _Worker(index, self._first_event_id, self._lane)
        return w

    def _widen(self) -> None:
        """Double the lane width and re-encode every packed value (rare: O(blocks))."""
        old, new = self._lane, self._lane * 2
        low = (1 << old) - 1
        self._held = {h: (v & low) | ((v >> old) & low) << new | (v >> 2 * old) << 2 * new
                      for h, v in self._held.items()}
        self._lane = new
        self._native = None                      # the C table holds 64-bit lanes only
        for w in self._workers.values():
            w.set_lane(new)
        for h in list(self._special):
            self._mark(h)

    # ---- queries --------------------------------------------------------
    def match(self, block_hashes: Sequence[int]) -> Matches:
        """Per worker holding at least the first block: its leading prompt
        blocks by tier (a :class:`Matches`, grouped by match length). Workers
        holding nothing are absent.

        It binary-searches where each group of workers stops matching
        (``_segments``: O(log n) lookups in the big map per group), then reads
        the ``_special`` map (C speed) over the blocks some worker matched: if
        no worker holding the first block is risky at a later one of them,
        each worker's blocks along the prompt are a prefix of it (module doc),
        so the search was right, and the off-device blocks are counted per
        segment; otherwise it reads every block (``_walk``). Both give the
        same answer.
        """
        out = Matches(self._ids, self._indices)
        if not block_hashes:
            return out
        if self._native is not None:
            self._native_match(out, block_hashes)
            return out
        alive = self._held.get(block_hashes[0], 0) & ((1 << self._lane) - 1)
        if not alive:
            return out
        segments = self._segments(block_hashes, alive)
        special = self._special
        kinds: set[int] = set()
        vals: list[int | None] = []
        if special:
            vals = list(map(special.get, block_hashes[:segments[-1][0]]))
            kinds = set(filter(None, vals))       # C speed; None: not special (a special value is never 0)
            if kinds and self._risky_after_first(vals, kinds, alive):
                self._walk(out, block_hashes)       # a worker holding the first block may skip one
                return out
        self._emit_segments(out, segments, vals, kinds)
        return out

    def _native_match(self, out: Matches, block_hashes: Sequence[int]) -> None:
        """``_walk`` in C (native.BlockTable.walk: every block, exact): one group per
        (length, host, disk) triple."""
        cache = self._match_cache
        for mask, length, host, disk in self._native.walk(block_hashes):  # type: ignore[union-attr]
            if host or disk:
                out.add(mask, MatchInfo(length - host - disk, host, disk))
            else:
                out.add(mask, cache[length] if length < len(cache) else self._device_match(length))

    def _emit_segments(self, out: Matches, segments: list[tuple[int, int, int]],
                       vals: list[int | None], kinds: set[int]) -> None:
        """One group per segment and per (host, disk) count: ``vals`` holds the
        matched blocks' ``_special`` values, ``kinds`` the distinct ones."""
        lane, cache = self._lane, self._match_cache
        only = next(iter(kinds)) if len(kinds) == 1 else None   # the common case: one kind, counted
        parts: dict[tuple[int, int], int] = {}   # (host, disk) blocks so far -> workers with them
        pos = 0
        for end, holders, leaving in segments:
            if kinds:                             # off-device blocks in [pos, end): all of holders hold them
                part = vals[pos:end] if pos or end < len(vals) else vals
                for v in kinds:
                    o = v & holders
                    if o:                         # (count(None) is identity compares: fast)
                        times = len(part) - part.count(None) if only is not None else part.count(v)
                        if times:
                            parts = _refine(parts, o, (v >> lane) & o, times)
            slow = 0
            for m in parts.values():
                slow |= m
            out.add(leaving & ~slow, cache[end] if end < len(cache) else self._device_match(end))
            for (host, disk), m in parts.items():
                if m & leaving:
                    out.add(m & leaving, MatchInfo(end - host - disk, host, disk))
            pos = end

    def _risky_after_first(self, vals: list[int | None], kinds: set[int], alive: int) -> bool:
        """Whether a worker in ``alive`` is risky at a block after the first (``vals``:
        the blocks' ``_special`` values, ``kinds`` the distinct ones)."""
        shift = 2 * self._lane
        if not reduce(or_, kinds) >> shift & alive:
            return False
        first = vals[0]
        return first is None or not first >> shift & alive or vals.count(first) > 1 or any(
            v >> shift & alive for v in kinds if v != first)

    def _segments(self, hashes: Sequence[int], alive: int) -> list[tuple[int, int, int]]:
        """Where each group of workers stops matching, read by binary search
        (right when each worker in ``alive`` holds a prefix of ``hashes``):
        ``(end, holders of hashes[:end], those of them ending there)`` per group.
        A group starting at a block with a length hint (``_hints``: the length
        last found from there, or of a STORED run starting there) tries that
        end first: two lookups when it holds."""
        held, hints = self._held.get, self._hints
        out: list[tuple[int, int, int]] = []
        n, pos = len(hashes), 0
        while True:
            lo, hi, at_hi = pos, n, 0             # all of alive holds hashes[lo]; hi: not all, or the end
            start = hashes[pos]
            guess = hints.get(start)
            if guess is not None and pos + guess <= n:
                lo, hi, at_hi = self._try_end(hashes, alive, pos, pos + guess)
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                v = held(hashes[mid], 0)
                if v & alive == alive:
                    lo = mid
                else:
                    hi, at_hi = mid, v
            if guess != hi - pos:
                self._hint(start, hi - pos)
            if hi == n:
                out.append((n, alive, alive))
                return out
            m = at_hi & alive
            out.append((hi, alive, alive & ~m))
            if not m:
                return out
            alive, pos = m, hi

    def _hint(self, start: int, length: int) -> None:
        hints = self._hints
        if len(hints) >= _HINTS:
            hints.clear()
        hints[start] = length

    def _try_end(self, hashes: Sequence[int], alive: int, lo: int, end: int) -> tuple[int, int, int]:
        """Narrow ``_segments``' search with a guessed end: ``(lo, hi, hi's packed masks)``."""
        held, n = self._held.get, len(hashes)
        if end - 1 > lo:
            v = held(hashes[end - 1], 0)
            if v & alive != alive:
                return lo, end - 1, v
            lo = end - 1
        if end == n:
            return lo, n, 0
        v = held(hashes[end], 0)
        if v & alive != alive:
            return lo, end, v
        return end, n, 0

    def _walk(self, out: Matches, block_hashes: Sequence[int]) -> None:
        """``match`` reading every block: exact whatever the chain shape."""
        held = self._held.get
        lane = self._lane
        lane_mask = (1 << lane) - 1
        alive = held(block_hashes[0], 0) & lane_mask
        counts = _SlicedCounts()
        length = 0
        for h in block_hashes:
            v = held(h, 0)
            m = v & alive
            if m != alive:
                self._emit(out, alive & ~m, length, counts)
                alive = m
                if not m:
                    return
            if v > lane_mask:                     # someone holds it off device
                o = (v >> lane) & alive
                if o:
                    counts.seen |= o
                    d = (v >> 2 * lane) & o
                    counts.add(counts.host, o & ~d)
                    if d:
                        counts.add(counts.disk, d)
            length += 1
        self._emit(out, alive, length, counts)

    def _emit(self, out: Matches, mask: int, length: int, counts: "_SlicedCounts") -> None:
        """Workers in ``mask`` match ``length`` blocks: one group for those holding
        them all on device, one per distinct (host, disk) count for the others."""
        slow = mask & counts.seen
        out.add(mask & ~slow, self._device_match(length))
        if slow:
            for part, host in _SlicedCounts.split(counts.host, slow):
                for same, disk in _SlicedCounts.split(counts.disk, part):
                    out.add(same, MatchInfo(length - host - disk, host, disk))

    def _device_match(self, length: int) -> MatchInfo:
        """Shared immutable MatchInfo(length): no allocation per worker per match."""
        cache = self._match_cache
        while len(cache) <= length:
            cache.append(MatchInfo(len(cache)))
        return cache[length]

    @property
    def native_table(self) -> native.BlockTable | None:
        """The C mirror ``match`` walks, None: the Python search serves (native_router.py reads it)."""
        return self._native

    @property
    def bit_ids(self) -> Sequence[str]:
        """Index bit -> worker id (appended to, never reordered; read-only by convention)."""
        return self._ids

    def bit_of(self, worker_id: str) -> int | None:
        """The worker's index bit (kept across its removal), None before its first event."""
        return self._indices.get(worker_id)

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


def _refine(parts: dict[tuple[int, int], int], off: int, disk: int, times: int) -> dict[tuple[int, int], int]:
    """``parts`` after ``times`` more blocks held off device by the workers in
    ``off`` (on disk for those in ``disk``, a subset; on the host for the rest)."""
    host = off & ~disk
    out: dict[tuple[int, int], int] = {}
    for (h, d), m in parts.items():
        for sub, key in ((m & host, (h + times, d)), (m & disk, (h, d + times)), (m & ~off, (h, d))):
            if sub:
                out[key] = out.get(key, 0) | sub
        off &= ~m
    if off & host:
        out[(times, 0)] = out.get((times, 0), 0) | (off & host)
    if off & disk:
        out[(0, times)] = out.get((0, times), 0) | (off & disk)
    return out


class _SlicedCounts:
    """Per-worker counters as bit planes: plane k of a list holds bit k of
    every worker's count. Adding a mask is a ripple carry across planes."""
    __slots__ = ("host", "disk", "seen")

    def __init__(self) -> None:
        self.host: list[int] = []
        self.disk: list[int] = []
        self.seen = 0                      # workers with any off-device block counted

    @staticmethod
    def add(planes: list[int], mask: int) -> None:
        k = 0
        while mask:
            if k == len(planes):
                planes.append(0)
            p = planes[k]
            planes[k] = p ^ mask
            mask &= p
            k += 1

    @staticmethod
    def split(planes: list[int], mask: int) -> list[tuple[int, int]]:
        """``mask`` partitioned by count: ``(sub-mask, count)`` per distinct count
        among its workers (a few integer operations per plane and part, however
        many workers share a count)."""
        parts = [(mask, 0)]
        for k, p in enumerate(planes):
            nxt = []
            for m, n in parts:
                one = m & p
                if one:
                    nxt.append((one, n | 1 << k))
                if one != m:
                    nxt.append((m & ~p, n))
            parts = nxt
        return parts

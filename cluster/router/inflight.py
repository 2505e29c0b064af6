"""`InFlightPrefixes`: prompt prefixes the router has sent somewhere, not yet reported.

A worker reports the blocks it holds (KV events) only after it has prefilled
them; requests sharing a prefix that arrive meanwhile would see no match and
be spread by load, recomputing the prefix elsewhere. So ``route()`` records
the block hashes of every request it sends to node N (the prefill node, or
the decode node when it prefills locally) as *expected soon* on N, for
``ttl_s`` seconds after it was sent, and for as long as its prefill is
pending: the Router refreshes the chains of the requests whose prefill has
not ended (``refresh``, sends.py), so a prompt queued 20 s at the knee still
draws its conversation's next turn.

One flat map ``hash -> (worker, epoch, expiry)``, written in bulk (C speed,
no per-block Python work on the routing path): the last node a block was
sent to owns it. Every send records a whole chain from the prompt's first
block, so the entries along a prompt are (nearly) prefix-closed and
``match()`` binary-searches for the deepest one: O(log n) lookups. It answers
one node and how many leading blocks it should hold (the chain it was sent).

Indexed blocks (real STORED events) take precedence over these entries (the
policy counts in-flight blocks only beyond a node's indexed prefix); a
REMOVED from the owner drops an entry; CLEARED or a dead worker drops all of
that worker's entries (an epoch bump: stale entries are ignored, then aged
out); a prefill that failed or was aborted drops its send's entries
(``on_removed``). Expiry is lazy: two generations of ``ttl_s`` each, the older dropped
whole, and each entry's own expiry checked on read.

The two maps live in a flat C table (native.InFlightTable) where it builds:
a record is one call writing the prompt's blocks with prefetches ahead, not
125 dict inserts into a 1.5M-entry dict (28 us of a decision), and a match
is the same binary search in C. The dicts stay for a host without it, and
take over (the table's entries copied) if a hash is not a 64-bit unsigned int.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from cluster.router import native
from cluster.router.native import InFlightTable


@dataclass(frozen=True, slots=True)
class InFlightMatch:
    worker_id: str
    blocks: int                            # leading prompt blocks expected on that worker


class InFlightPrefixes:
    def __init__(self, ttl_s: float, *, use_native: bool = True) -> None:
        if ttl_s <= 0:
            raise ValueError(f"in-flight prefix ttl must be positive seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self._cur: dict[int, tuple[str, int, float]] = {}
        self._prev: dict[int, tuple[str, int, float]] = {}
        self._gen_start: float | None = None
        self._epochs: dict[str, int] = {}
        self._table = native.in_flight_table() if use_native else None   # None: the dicts
        self._numbers: dict[str, int] = {}     # worker id -> its number in the table
        self._names: list[str] = []            # number -> worker id
        self._epoch_of: list[int] = []         # number -> its epoch (the table's copy of _epochs)

    @property
    def native(self) -> bool:
        """Whether the C table holds the entries (else the dicts)."""
        return self._table is not None

    @property
    def table(self) -> InFlightTable | None:
        """The C table holding the entries, None: the dicts (native_router.py decides through it)."""
        return self._table

    @property
    def epochs(self) -> list[int]:
        """Worker number -> its epoch (the list the C table reads; never replaced)."""
        return self._epoch_of

    def record(self, worker_id: str, block_hashes: Sequence[int], now: float) -> None:
        """``block_hashes`` (a prompt's chain from its first block) were sent to ``worker_id``."""
        if not block_hashes:
            return
        self._age(now)
        epoch = self._epochs.get(worker_id, 0)
        if self._table is not None:
            try:
                self._table.record(block_hashes, self.number(worker_id), epoch, now + self.ttl_s)
                return
            except (OverflowError, TypeError):
                self._to_dicts()
        self._cur.update(dict.fromkeys(block_hashes, (worker_id, epoch, now + self.ttl_s)))

    def refresh(self, worker_id: str, block_hashes: Sequence[int], now: float) -> None:
        """A send of ``block_hashes`` to ``worker_id`` is still pending: its chain lives ``ttl_s``
        from now. A live entry keeps its owner (a later send to another node took it), a missing,
        lapsed or stale one is written as this send's, so the chain stays whole from its first block."""
        if not block_hashes:
            return
        self._age(now)
        epoch, expiry = self._epochs.get(worker_id, 0), now + self.ttl_s
        if self._table is not None:
            try:
                self._table.refresh(block_hashes, self.number(worker_id), epoch, expiry, now, self._epoch_of)
                return
            except (OverflowError, TypeError):
                self._to_dicts()
        for h in block_hashes:
            v = self._live(h, now)
            self._cur[h] = (worker_id, epoch, expiry) if v is None else (v[0], v[1], max(v[2], expiry))

    def match(self, block_hashes: Sequence[int], now: float) -> InFlightMatch | None:
        """The node the deepest in-flight block of this prompt was sent to, and
        that block's depth (every send carries the whole chain up to it)."""
        if not block_hashes or (self._table.empty() if self._table is not None
                                else not self._cur and not self._prev):
            return None
        self._age(now)
        if self._table is not None:
            got = self._table.match(block_hashes, now, self._epoch_of)
            return None if got is None else InFlightMatch(self._names[got[0]], got[1])
        first = self._live(block_hashes[0], now)
        if first is None:
            return None
        lo, hi, best = 0, len(block_hashes), first       # lo valid, hi invalid (or past the end)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            v = self._live(block_hashes[mid], now)
            if v is None:
                hi = mid
            else:
                lo, best = mid, v
        return InFlightMatch(best[0], lo + 1)

    def on_removed(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """The worker evicted these blocks: it no longer holds what was sent there."""
        hashes = block_hashes if isinstance(block_hashes, (list, tuple)) else list(block_hashes)
        if self._table is not None:
            number = self._numbers.get(worker_id)
            if number is not None:
                self._table.on_removed(number, hashes)
            return
        for gen in (self._cur, self._prev):      # (both: an iterator is read once, above)
            if not gen:
                continue
            for h in hashes:
                v = gen.get(h)
                if v is not None and v[0] == worker_id:
                    del gen[h]

    def drop_worker(self, worker_id: str) -> None:
        """CLEARED, or the worker died: forget everything sent to it."""
        self._epochs[worker_id] = epoch = self._epochs.get(worker_id, 0) + 1
        number = self._numbers.get(worker_id)
        if number is not None:
            self._epoch_of[number] = epoch

    def __len__(self) -> int:
        if self._table is not None:
            return len(self._table)
        return len(self._cur.keys() | self._prev.keys())

    def number(self, worker_id: str) -> int:
        """The worker's number in the C table (given on first use)."""
        number = self._numbers.get(worker_id)
        if number is None:
            number = self._numbers[worker_id] = len(self._names)
            self._names.append(worker_id)
            self._epoch_of.append(self._epochs.get(worker_id, 0))
        return number

    def _to_dicts(self) -> None:
        """Leave the C table for the dicts, its entries copied (a hash it cannot hold came)."""
        assert self._table is not None
        cur, prev = self._table.dump()
        names = self._names
        self._cur = {h: (names[w], e, x) for h, w, e, x in cur}
        self._prev = {h: (names[w], e, x) for h, w, e, x in prev}
        self._gen_start = self._table.gen_start()
        self._table = None

    def _live(self, h: int, now: float) -> tuple[str, int, float] | None:
        v = self._cur.get(h) or self._prev.get(h)
        if v is None or v[2] <= now or self._epochs.get(v[0], 0) != v[1]:
            return None
        return v

    def _age(self, now: float) -> None:
        if self._table is not None:
            self._table.age(now, self.ttl_s)         # the same, the generation's start kept in C
            return
        if self._gen_start is None:
            self._gen_start = now
        elif now - self._gen_start >= self.ttl_s:
            keep = now - self._gen_start < 2 * self.ttl_s
            self._prev = self._cur if keep else {}
            self._cur = {}
            self._gen_start = now


class NoInFlightPrefixes:
    """The null tracker (``track_in_flight=False``): prefixes count only once a worker reports them.

    Tracking sent prefixes (the default) pays because the engine makes a request
    wait for a prefix another running request on the node is computing
    (engine/prefix_wait.py); without it a group's second request, sent before
    the first one's KV events arrive, sees no holder and recomputes the prefix
    on another node (benchmarks/routing.py, docs/benchmarks.md)."""

    def record(self, worker_id: str, block_hashes: Sequence[int], now: float) -> None:
        return None

    def match(self, block_hashes: Sequence[int], now: float) -> None:
        return None

    def on_removed(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        return None

    def refresh(self, worker_id: str, block_hashes: Sequence[int], now: float) -> None:
        return None

    def drop_worker(self, worker_id: str) -> None:
        return None

    def __len__(self) -> int:
        return 0

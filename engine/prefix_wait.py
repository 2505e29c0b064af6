"""Waiting for prompt blocks another request is computing right now.

A prefix hit needs a full, cached block; a block a running request is still
prefilling (chunked prefill, or admitted in the same step) is not cached yet.
A waiting request whose next uncached prompt block is one of those (same
chained hash) is *deferred*: it stays in the waiting queue, the scheduler
goes on to the next one, and once the owner has cached the blocks the
follower is admitted with them as prefix hits and computes only the rest.

No deadlock: only a RUNNING request's uncomputed prompt blocks are pending,
and running requests are scheduled before waiting ones. An owner that is
preempted, aborted or finished leaves ``running``, so its blocks stop being
pending and the follower computes them itself; a follower never waits on
decode (output) blocks. A hash collision costs at most a wait: the hit is
still checked token for token when the follower is admitted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from engine.kv_lookup import ComputedBlocks, ResumedBlocks
from engine.request import Request


@dataclass(frozen=True)
class PrefixWaitStats:
    """Cumulative counts of one scheduler."""
    waits: int = 0               # requests deferred at least once for an in-flight prefix
    blocks_saved: int = 0        # blocks those requests took as hits that were in flight when they deferred


class PrefixWaits:
    def __init__(self, block_size: int, enabled: bool = True) -> None:
        self.block_size = block_size
        self.enabled = enabled                   # False when prefix caching is off: nothing would ever hit
        self._first_hits: dict[str, int] = {}    # deferred request -> hit blocks when it first deferred
        self._stats = PrefixWaitStats()

    @property
    def stats(self) -> PrefixWaitStats:
        return self._stats

    @property
    def num_deferred(self) -> int:
        """Waiting requests that deferred at least once and are not admitted yet."""
        return len(self._first_hits)

    def pending(self, running: Iterable[Request]) -> dict[int, str]:
        """Block hash -> id of the running request computing that prompt block now."""
        out: dict[int, str] = {}
        if self.enabled:
            for request in running:
                self.add_owner(out, request)
        return out

    def add_owner(self, pending: dict[int, str], request: Request) -> None:
        """Add ``request``'s prompt blocks it has not computed yet (call when it is
        admitted in this step, so a follower behind it in the queue waits)."""
        bs, computed = self.block_size, request.num_computed_tokens
        n_full = request.num_prompt_tokens // bs
        if not self.enabled or computed >= n_full * bs:
            return
        hashes, rid = request.block_hashes, request.request_id
        for i in range(computed // bs, min(n_full, len(hashes))):
            pending.setdefault(hashes[i], rid)

    def should_wait(self, request: Request, computed: ComputedBlocks, pending: dict[int, str]) -> bool:
        """True (and counted) when the request's next uncached block is in flight."""
        if not pending or isinstance(computed, ResumedBlocks):
            return False
        j, hashes = len(computed.blocks), request.block_hashes
        if j >= len(hashes) or j * self.block_size >= request.num_tokens - 1:
            return False
        owner = pending.get(hashes[j])
        if owner is None or owner == request.request_id:
            return False
        if request.request_id not in self._first_hits:
            self._first_hits[request.request_id] = j
            self._stats = PrefixWaitStats(self._stats.waits + 1, self._stats.blocks_saved)
        return True

    def admitted(self, request: Request, computed: ComputedBlocks) -> None:
        """The request starts running with ``computed``: count what waiting saved."""
        first = self._first_hits.pop(request.request_id, None)
        if first is not None and len(computed.blocks) > first:
            self._stats = PrefixWaitStats(self._stats.waits,
                                          self._stats.blocks_saved + len(computed.blocks) - first)

    def forget(self, request_id: str) -> None:
        """The request left the scheduler while deferred."""
        self._first_hits.pop(request_id, None)

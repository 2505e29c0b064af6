"""What a prefill node hands a decode node: where the prompt's KV lies."""
from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.engine import PeerInfo
from kvtransfer.head_plan import HeadShard


@dataclass(frozen=True)
class RankSource:
    """One tensor-parallel rank of the source: how to reach its pool and which KV heads it holds."""
    peer: PeerInfo
    shard: HeadShard


@dataclass(frozen=True)
class KVHandle:
    """`block_ids` on `peer` hold the KV of the first `num_tokens` tokens,
    pinned under a lease for `lease_ttl_s` seconds from when it was issued.
    Reading them with `notify=request_id` releases the lease on the source.
    `preemptions`: how often the source recomputed the prompt on the way (a
    reader that read blocks ahead, at another count, reads them again).
    `ranks`: every rank of the source, rank 0 (`peer`) first, with its KV heads; the block
    ids mean the same block on each. Empty: one rank, `peer`, holding every head."""
    request_id: str
    peer: PeerInfo
    block_ids: tuple[int, ...]
    num_tokens: int
    lease_ttl_s: float
    preemptions: int = 0
    ranks: tuple[RankSource, ...] = ()

    @property
    def tensor_parallel(self) -> bool:
        """Whether the source splits the heads over ranks (a reader must plan head ranges)."""
        return len(self.ranks) > 1

"""What a prefill node hands a decode node: where the prompt's KV lies."""
from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.engine import PeerInfo


@dataclass(frozen=True)
class KVHandle:
    """`block_ids` on `peer` hold the KV of the first `num_tokens` tokens,
    pinned under a lease for `lease_ttl_s` seconds from when it was issued.
    Reading them with `notify=request_id` releases the lease on the source.
    `preemptions`: how often the source recomputed the prompt on the way (a
    reader that read blocks ahead, at another count, reads them again)."""
    request_id: str
    peer: PeerInfo
    block_ids: tuple[int, ...]
    num_tokens: int
    lease_ttl_s: float
    preemptions: int = 0

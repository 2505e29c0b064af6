"""Small result objects of the KV cache manager's lookups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from engine.block_pool import KVBlock
from engine.tiers.types import TierEntry


class ComputedBlocks(NamedTuple):
    """Result of a prefix-cache lookup: hit blocks in order and the tokens
    they cover. A hit is a device block, or a lower-tier entry that admission
    pages in."""
    blocks: tuple[KVBlock | TierEntry, ...]
    num_computed_tokens: int

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks if isinstance(b, KVBlock)]

    @property
    def num_lower_hits(self) -> int:
        return sum(1 for b in self.blocks if isinstance(b, TierEntry))


class ResumedBlocks(ComputedBlocks):
    """A swapped-out request's own blocks (host slots), not a prefix hit."""


@dataclass(frozen=True)
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

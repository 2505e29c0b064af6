"""Small value types of the KV tiers: where a block sits and how it moves."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from engine.kv_events import Tier

T = TypeVar("T")


def cached(value: T | None) -> T:
    """A cached block's hash or tokens: always set (None only on a private block,
    which never reaches the caller; an AssertionError if one does)."""
    if value is None:
        raise AssertionError("a private block where only cached blocks belong")
    return value


@dataclass(frozen=True)
class TierSizes:
    """Slots (one KV block each) of the lower tiers; 0 turns a tier off."""
    host_blocks: int = 0
    disk_blocks: int = 0

    def __post_init__(self) -> None:
        if self.host_blocks < 0 or self.disk_blocks < 0:
            raise ValueError(f"tier sizes must be >= 0 blocks, got host={self.host_blocks} "
                             f"disk={self.disk_blocks}")


@dataclass(eq=False)
class TierEntry:
    """A block held in a lower tier (host or disk) at ``slot``. A cached
    block carries its hash, parent hash and tokens; a swapped-out block of a
    preempted request is private (``block_hash`` None)."""
    tier: Tier
    slot: int
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: bytes | None = None     # packed uint32 (engine.block_hash.packed_tokens)

    @property
    def is_private(self) -> bool:
        return self.block_hash is None


@dataclass(frozen=True)
class KVMove:
    """Copy one block from ``src`` in ``src_tier`` to ``dst`` in ``dst_tier``.
    A device -> device move is a copy-on-write copy."""
    src_tier: Tier
    src: int
    dst_tier: Tier
    dst: int

    @classmethod
    def copy(cls, src: int, dst: int) -> "KVMove":
        return cls(Tier.DEVICE, src, Tier.DEVICE, dst)

    @property
    def is_copy(self) -> bool:
        return self.src_tier is Tier.DEVICE and self.dst_tier is Tier.DEVICE


class MoveLog:
    """Block moves in decision order. Executing them in this order before the
    next forward is exactly "as if each had happened when decided": the
    device holds the state of the last forward until the log is flushed."""

    def __init__(self) -> None:
        self._moves: list[KVMove] = []

    def __len__(self) -> int:
        return len(self._moves)

    def add(self, src_tier: Tier, src: int, dst_tier: Tier, dst: int) -> None:
        self._moves.append(KVMove(src_tier, src, dst_tier, dst))

    def take(self) -> list[KVMove]:
        moves, self._moves = self._moves, []
        return moves

    def drop_copies_into(self, block_ids: set[int]) -> None:
        """Forget pending copy-on-write copies into blocks being freed."""
        self._moves = [m for m in self._moves if not (m.is_copy and m.dst in block_ids)]


@dataclass(frozen=True)
class SwapRecord:
    """A request preempted by swap: its first blocks sit in these host slots
    and hold its first ``num_tokens`` tokens."""
    slots: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class TierCounters:
    """Cumulative block movements between tiers (blocks, not bytes)."""
    page_outs: int = 0          # cached blocks moved down a tier (device -> host -> disk)
    page_ins: int = 0           # cached blocks paged back into the device on a prefix hit
    dropped: int = 0            # cached blocks that fell off the last tier
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0

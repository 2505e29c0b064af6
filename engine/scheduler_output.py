"""What the scheduler hands the model runner for one engine step."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request
from engine.tiers.types import KVMove


@dataclass(slots=True)
class ScheduledSeq:
    """Compute ``num_new_tokens`` tokens of ``request`` starting at
    ``request.num_computed_tokens``; ``block_ids`` is its whole block table
    (already large enough for those tokens). ``sample`` is True when this
    chunk reaches the end of the known tokens, so a next token is sampled."""
    request: Request
    num_new_tokens: int
    block_ids: list[int]
    sample: bool


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # block copies the runner performs before the forward (copy-on-write): (src, dst)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # every block move of this step in decision order (copy-on-write copies
    # included, so block_copies lists its device -> device moves); when empty,
    # block_copies alone is executed
    kv_moves: list[KVMove] = field(default_factory=list)

    def moves(self) -> list[KVMove]:
        """What the runner executes, in order, before the forward."""
        return self.kv_moves or [KVMove.copy(s, d) for s, d in self.block_copies]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

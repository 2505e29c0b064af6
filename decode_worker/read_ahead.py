"""What a decode worker read ahead into a reservation, and what is left for the submit.

A prefill node tells the decode node of prompt blocks as they complete: whole
blocks after each earlier chunk's step, and layer groups (layers ``[l0, l1)`` of
every block of the last chunk) while the last chunk computes. Each such message
becomes one read; at the submit, the reads that ended well and still describe the
handle's KV count per (block, layer range): read from the handle's source (agent
name and incarnation), at its preemption count, from the very source block the
handle names for that prompt block. Everything else is read again: a request
never joins its batch with a layer of a block missing.

Pure bookkeeping (no I/O): :func:`plan_rest` is what the submit reads.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

from kvtransfer.engine import TransferStatus

LayerRange = tuple[int, int]
ReadResult = tuple[TransferStatus, int, int, str]   # status, bytes, descriptors, error


@dataclass(frozen=True)
class AheadRead:
    """One read into reserved blocks before the submit: prompt block `indices` from the
    source's `src` blocks as of its `preemptions` count; `layers` None: whole blocks."""
    source: tuple[str, str]    # the peer's (agent name, incarnation)
    indices: tuple[int, ...]
    src: tuple[int, ...]
    preemptions: int
    layers: LayerRange | None = None


@dataclass(frozen=True)
class PendingRead:
    read: AheadRead
    task: asyncio.Task[ReadResult]


def finished_well(pending: Sequence[PendingRead]) -> list[PendingRead]:
    """The reads (all ended: awaited) whose bytes landed."""
    out = []
    for p in pending:
        if p.task.cancelled() or p.task.exception() is not None:
            continue
        if p.task.result()[0] is TransferStatus.DONE:
            out.append(p)
    return out


@dataclass(frozen=True)
class RestRead:
    """Still to read at the submit: `layers` (ranges, in order) of prompt blocks `indices`."""
    layers: tuple[LayerRange, ...]
    indices: tuple[int, ...]

    def whole(self, num_layers: int) -> bool:
        return self.layers == ((0, num_layers),)


@dataclass(frozen=True)
class RestPlan:
    reads: tuple[RestRead, ...]
    ahead_blocks: int          # blocks wholly read ahead (nothing left)
    layer_blocks: int          # blocks partly read ahead (some layers left)
    ahead_layers: int          # (block, layer) pairs read ahead and used

    @property
    def blocks(self) -> int:
        """Blocks read (ahead or now) at all."""
        return self.ahead_blocks + len({i for r in self.reads for i in r.indices})


def plan_rest(done: Sequence[AheadRead], *, source: tuple[str, str], preemptions: int,
              src_blocks: Sequence[int], first: int, end: int, num_layers: int) -> RestPlan:
    """What the submit reads of prompt blocks ``[first, end)`` (their source blocks
    ``src_blocks[i]``) after the reads `done`: per block, the layers no good read
    covered, grouped by equal ranges (one read each; whole blocks first). If reads
    ahead covered everything, the last block is read again, whole: the read that carries
    the notification ending the source's lease."""
    covered: dict[int, list[LayerRange]] = {}
    for r in done:
        if r.source != source or r.preemptions != preemptions:
            continue
        rng = r.layers or (0, num_layers)
        for i, s in zip(r.indices, r.src):
            if first <= i < end and src_blocks[i] == s:
                covered.setdefault(i, []).append(rng)
    groups: dict[tuple[LayerRange, ...], list[int]] = {}
    for i in range(first, end):
        missing = _missing(covered.get(i, []), num_layers)
        if missing:
            groups.setdefault(missing, []).append(i)
    if covered and not groups:
        groups[((0, num_layers),)] = [end - 1]
    reads = sorted((RestRead(k, tuple(v)) for k, v in groups.items()), key=lambda r: not r.whole(num_layers))
    left = {i: sum(b - a for a, b in r.layers) for r in reads for i in r.indices}
    partly = [i for i, n in left.items() if n < num_layers]
    return RestPlan(reads=tuple(reads), ahead_blocks=sum(1 for i in range(first, end) if i in covered and i not in left),
                    layer_blocks=len(partly),
                    ahead_layers=sum(num_layers - left.get(i, 0) for i in covered if first <= i < end))


def _missing(ranges: list[LayerRange], num_layers: int) -> tuple[LayerRange, ...]:
    """The parts of ``[0, num_layers)`` no range covers, in order."""
    out: list[LayerRange] = []
    at = 0
    for a, b in sorted(ranges):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < num_layers:
        out.append((at, num_layers))
    return tuple(out)

"""`RoleCosts`: one role's live workers as arrays, for costing all at once.

A prefix-aware decision costs every live worker of a role: a load-only term
(queue, batch, KV usage) plus a term set by how much of the prompt the
worker holds. With many workers sharing a common prefix (every prompt of a
conversation trace starts with the same system block) almost every worker
matches, so no shortcut through "the few that match" exists. Instead the
load-only terms are kept in a float64 array in the view's order, updated in
place when one worker's load changes, and a decision adds the match term
per group of workers with the same match (``Matches.groups``, one numpy
assignment each) and takes the first minimum.

A role of up to ``LIST_MAX`` workers is costed with the same terms kept as
a Python list (``key_list``) and a group's positions remembered per mask
(``member_positions``): at 32 workers a list summed with ``map`` is faster
than numpy's per-call overhead.

The arithmetic is the policy's scalar formula, done elementwise in float64
in the same order, so the chosen worker and its cost are exactly those of
costing each worker in Python (tests/unit/test_router_cost_vector.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    from cluster.router.index import Matches
    from cluster.router.policy import WorkerLoad, WorkerView

KeyFn = Callable[["WorkerLoad"], float]

_FEW_BITS = 12          # a group this small is walked bit by bit; larger ones are unpacked by numpy
LIST_MAX = 64           # a role this small is costed with Python lists (C-speed map / min), not numpy
_CACHED_MASKS = 4096    # mask -> positions entries kept (cleared whole when full)


class RoleCosts:
    def __init__(self, views: Sequence["WorkerView"], key: KeyFn) -> None:
        self.views = tuple(views)
        self._key = key
        self._pos = {v.worker_id: i for i, v in enumerate(self.views)}
        self.key_list = [key(v.load) for v in self.views]
        # the same keys as float64, for roles costed with numpy; a list-costed role
        # builds it only when read (no numpy call per decision)
        self._keys: np.ndarray | None = (np.array(self.key_list, dtype=np.float64)
                                         if len(self.views) > LIST_MAX else None)
        self._mask_pos: dict[int, tuple[int, ...]] = {}
        self._bytes: list[dict[int, tuple[int, ...]]] = []  # byte index -> byte value -> positions
        self._bit_pos = np.zeros(0, dtype=np.int64)     # index bit -> position here, -1 if not a member

    def __len__(self) -> int:
        return len(self.views)

    def update(self, view: "WorkerView", views: Sequence["WorkerView"]) -> None:
        """A member's load changed; ``views`` is the role's new tuple (same members, same order)."""
        i = self._pos.get(view.worker_id)
        if i is None:
            raise ValueError(f"worker {view.worker_id!r} is not in this RoleCosts: rebuild it when the "
                             "set of live workers changes")
        self.key_list[i] = k = self._key(view.load)
        if self._keys is not None:
            self._keys[i] = k
        self.views = views if isinstance(views, tuple) else tuple(views)

    @property
    def keys(self) -> np.ndarray:
        """The load-only terms as a float64 array, in the members' order."""
        if self._keys is None:
            self._keys = np.array(self.key_list, dtype=np.float64)
        return self._keys

    def position(self, worker_id: str) -> int | None:
        return self._pos.get(worker_id)

    def positions(self, mask: int, ids: Sequence[str]) -> np.ndarray | list[int]:
        """Positions of the members whose index bit is set in ``mask`` (``ids``: the
        index's bit -> worker id list)."""
        if mask.bit_count() <= _FEW_BITS:
            return self._walk_bits(mask, ids)
        bit_pos = self._bit_positions(ids)
        n = len(bit_pos)
        bits = np.flatnonzero(np.unpackbits(np.frombuffer(mask.to_bytes((n + 7) // 8, "little"), dtype=np.uint8),
                                             bitorder="little"))
        p = bit_pos[bits]
        return p[p >= 0]

    def member_positions(self, mask: int, ids: Sequence[str]) -> tuple[int, ...]:
        """``positions`` as a tuple, remembered per mask (a prompt's groups repeat:
        the workers holding a popular prefix); bits are never reassigned, so an
        entry stays true while the members do (a new RoleCosts on any change)."""
        got = self._mask_pos.get(mask)
        if got is None:
            if len(self._mask_pos) >= _CACHED_MASKS:
                self._mask_pos.clear()
            got = self._mask_pos[mask] = self._byte_positions(mask, ids)
        return got

    def _byte_positions(self, mask: int, ids: Sequence[str]) -> tuple[int, ...]:
        """``_walk_bits`` a byte of the mask at a time: each (byte index, byte value)
        maps to its members' positions once (``_bytes``), so a mask of many bits
        is a few lookups, not a Python step per bit. Same order: lowest bit first."""
        out: list[int] = []
        tables, j = self._bytes, 0
        while mask:
            b = mask & 255
            if b:
                while j >= len(tables):
                    tables.append({})
                got = tables[j].get(b)
                if got is None:
                    got = tables[j][b] = tuple(self._walk_bits(b << 8 * j, ids))
                out += got
            mask >>= 8
            j += 1
        return tuple(out)

    def _walk_bits(self, mask: int, ids: Sequence[str]) -> list[int]:
        """Positions of the members whose bit is set, lowest bit first (a Python walk: for few bits)."""
        out, pos = [], self._pos
        while mask:
            low = mask & -mask
            mask ^= low
            i = pos.get(ids[low.bit_length() - 1])
            if i is not None:
                out.append(i)
        return out

    def _bit_positions(self, ids: Sequence[str]) -> np.ndarray:
        """bit -> position, extended to the index's current bits (bits are never reassigned)."""
        have = len(self._bit_pos)
        if have < len(ids):
            pos = self._pos
            more = np.fromiter((pos.get(ids[b], -1) for b in range(have, len(ids))),
                               dtype=np.int64, count=len(ids) - have)
            self._bit_pos = np.concatenate([self._bit_pos, more])
        return self._bit_pos

    def match_blocks(self, matches: "Matches") -> np.ndarray:
        """Matched blocks (all tiers and in flight) per member, 0 where none."""
        blocks = np.zeros(len(self.views), dtype=np.int64)
        for mask, info in matches.groups:
            blocks[self.positions(mask, matches.ids)] = info.blocks
        for wid, info in matches.extra.items():
            i = self._pos.get(wid)
            if i is not None:
                blocks[i] = info.blocks
        return blocks

"""A token list kept as native uint32 bytes.

`TokenBytes` reads like the ``list[int]`` a `Request` holds (``len``, items,
slices, iteration, ``==``, ``+``) but stores the tokens as the bytes that
`engine.block_hash.packed_tokens` makes, unpacking only what is read. The
fleet simulator builds prompts of thousands of tokens per request from
numpy; its engines read a prompt's length and its packed bytes (hashes and
the prefix cache's check), never its items, so a list of ints per prompt
was pure cost (a fifth of a loaded simulation's wall time went to building
prompts, most of it ``tolist``).
"""
from __future__ import annotations

from typing import Iterator, Sequence


class TokenBytes(Sequence[int]):
    __slots__ = ("data", "_view")

    def __init__(self, data: bytes) -> None:
        if len(data) % 4:
            raise ValueError(f"TokenBytes: {len(data)} bytes is not a whole number of 4-byte tokens; pass "
                             "engine.block_hash.packed_tokens(tokens) or numpy uint32 .tobytes()")
        self.data = bytes(data)
        self._view = memoryview(self.data).cast("I")

    def __len__(self) -> int:
        return len(self._view)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._view[i].tolist()
        return self._view[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self._view)

    def tolist(self) -> list[int]:
        return self._view.tolist()

    def __eq__(self, other) -> bool:
        if isinstance(other, TokenBytes):
            return self.data == other.data
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and self._view.tolist() == list(other)
        return NotImplemented

    # unhashable like the list it stands for (typeshed types object.__hash__ as a method)
    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Sequence[int]) -> list[int]:
        return self._view.tolist() + list(other)

    def __radd__(self, other: Sequence[int]) -> list[int]:
        return list(other) + self._view.tolist()

    def __reduce__(self):
        return TokenBytes, (self.data,)

    def __repr__(self) -> str:
        return f"TokenBytes({len(self)} tokens)"

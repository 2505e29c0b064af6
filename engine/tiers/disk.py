"""The disk tier's data: one file of fixed-size slots under a directory.

Slot ``i`` is at byte offset ``i * bytes_per_block``; the file never grows
beyond ``num_slots * bytes_per_block``, which the configured bound caps. The
file is private to one engine (its name carries the process id and a random
suffix) and is deleted when the store is closed or collected.
"""
from __future__ import annotations

import os
import uuid
import weakref
from pathlib import Path
from typing import Sequence

import torch


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first index in ``slots``, first slot, length) of runs of consecutive slots."""
    out: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == slot and out[-1][0] + out[-1][2] == i:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, slot, 1))
    return out


class DiskStore:
    def __init__(self, directory: str | Path, num_slots: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        if num_slots < 1:
            raise ValueError(f"the disk tier needs >= 1 slot, got {num_slots}: raise disk_kv_bytes")
        directory = Path(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"disk_kv_dir {str(directory)!r} cannot be created ({e}); "
                             "point it at a writable directory") from e
        self.num_slots = num_slots
        self.block_shape = block_shape
        self.dtype = dtype
        self.bytes_per_block = torch.empty(block_shape, dtype=dtype).nbytes
        self.path = directory / f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._finalizer = weakref.finalize(self, _close, self._fd, self.path)

    @property
    def max_bytes(self) -> int:
        return self.num_slots * self.bytes_per_block

    def write(self, slots: Sequence[int], data: torch.Tensor) -> None:
        """``data[i]`` (a CPU tensor of blocks) goes to slot ``slots[i]``."""
        self._check(slots)
        raw = data.contiguous().view(torch.uint8).reshape(len(slots), self.bytes_per_block).numpy()
        for first, slot, n in _runs(slots):
            view = raw[first:first + n].data.cast("B")
            offset = slot * self.bytes_per_block
            while view:
                written = os.pwrite(self._fd, view, offset)
                view, offset = view[written:], offset + written

    def read(self, slots: Sequence[int]) -> torch.Tensor:
        """The blocks in ``slots`` as one CPU tensor ``[len(slots), *block_shape]``."""
        self._check(slots)
        out = torch.empty((len(slots), *self.block_shape), dtype=self.dtype)
        raw = out.view(torch.uint8).reshape(len(slots), self.bytes_per_block).numpy()
        for first, slot, n in _runs(slots):
            view = raw[first:first + n].data.cast("B")
            offset = slot * self.bytes_per_block
            while view:
                got = os.preadv(self._fd, [view], offset)
                if got <= 0:
                    raise OSError(f"{self.path}: short read at slot {offset // self.bytes_per_block}")
                view, offset = view[got:], offset + got
        return out

    def file_bytes(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        self._finalizer()

    def _check(self, slots: Sequence[int]) -> None:
        bad = [s for s in slots if not 0 <= s < self.num_slots]
        if bad:
            raise ValueError(f"disk slots {bad} outside [0, {self.num_slots})")


def _close(fd: int, path: Path) -> None:
    try:
        os.close(fd)
    finally:
        path.unlink(missing_ok=True)

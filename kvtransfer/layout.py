"""Where a registered KV pool lives in memory, in bytes (no model knowledge).

A pool is block-major: block ``i`` occupies the contiguous bytes
``[base_addr + i * bytes_per_block, base_addr + (i + 1) * bytes_per_block)``.
The engine's pool tensor ``[num_blocks, num_layers, 2, kv_heads, block_size,
head_dim]`` (contiguous) has exactly this shape in memory, so one run of
consecutive blocks is one transfer descriptor.

``slice_offset`` / ``slice_bytes`` describe one contiguous part of every
block (the bytes ``[slice_offset, slice_offset + slice_bytes)``); only that
part is transferred and runs of blocks are then not merged. By default the
slice is the whole block. Tensor-parallel ranks hold their own KV heads in
pools of their own; which bytes move between ranks of different TP sizes is
planned in :mod:`kvtransfer.head_plan`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class KVPoolLayout:
    base_addr: int
    num_blocks: int
    bytes_per_block: int
    mem_type: str = "DRAM"
    device_id: int = 0
    slice_offset: int = 0
    slice_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.base_addr <= 0:
            raise ValueError(f"base_addr must be a positive address, got {self.base_addr}; "
                             "build the layout with KVPoolLayout.from_tensor(pool)")
        if self.num_blocks <= 0 or self.bytes_per_block <= 0:
            raise ValueError(f"num_blocks ({self.num_blocks}) and bytes_per_block "
                             f"({self.bytes_per_block}) must both be > 0")
        if self.mem_type not in MEM_TYPES:
            raise ValueError(f"mem_type must be one of {MEM_TYPES}, got {self.mem_type!r}")
        if self.device_id < 0:
            raise ValueError(f"device_id must be >= 0, got {self.device_id}")
        end = self.slice_offset + self.block_transfer_bytes
        if self.slice_offset < 0 or self.block_transfer_bytes <= 0 or end > self.bytes_per_block:
            raise ValueError(
                f"slice [{self.slice_offset}, {end}) must lie inside a block of "
                f"{self.bytes_per_block} bytes; pass slice_offset >= 0 and "
                f"0 < slice_bytes <= bytes_per_block - slice_offset")

    @classmethod
    def from_tensor(cls, pool: Any, slice_offset: int = 0,
                    slice_bytes: Optional[int] = None) -> "KVPoolLayout":
        """Layout of a contiguous block-major torch tensor (first dim = blocks)."""
        if not pool.is_contiguous():
            raise ValueError("the KV pool tensor must be contiguous (block-major); "
                             "allocate it with torch.empty(...) and do not pass a view")
        if pool.dim() < 1 or pool.shape[0] == 0 or pool.numel() == 0:
            raise ValueError(f"the KV pool tensor needs a non-empty first (block) dim, "
                             f"got shape {tuple(pool.shape)}")
        device = pool.device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"pool device {device} is not supported: use a cpu or cuda tensor")
        nbytes = pool.numel() * pool.element_size()
        return cls(base_addr=pool.data_ptr(), num_blocks=int(pool.shape[0]),
                   bytes_per_block=nbytes // int(pool.shape[0]),
                   mem_type="VRAM" if device.type == "cuda" else "DRAM",
                   device_id=device.index or 0,
                   slice_offset=slice_offset, slice_bytes=slice_bytes)

    @property
    def block_transfer_bytes(self) -> int:
        """Bytes moved per block (the rank's slice, or the whole block)."""
        return self.bytes_per_block if self.slice_bytes is None else self.slice_bytes

    @property
    def whole_blocks(self) -> bool:
        return self.slice_offset == 0 and self.block_transfer_bytes == self.bytes_per_block

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def block_addr(self, block_id: int) -> int:
        """Address of the transferred bytes of ``block_id`` (slice start)."""
        return self.base_addr + block_id * self.bytes_per_block + self.slice_offset

    def layer_range(self, num_layers: int, first: int, end: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of layers ``[first, end)`` inside a block whose bytes are
        ``num_layers`` equal slabs, layer after layer (the engine's block-major pool, its
        quantized form too): one contiguous range of each block."""
        if num_layers < 1 or self.bytes_per_block % num_layers:
            raise ValueError(f"a block of {self.bytes_per_block} B does not split into {num_layers} layers: "
                             "pass the pool's own layer count")
        if not 0 <= first < end <= num_layers:
            raise ValueError(f"layers [{first}, {end}) are not a non-empty range inside [0, {num_layers})")
        per = self.bytes_per_block // num_layers
        return first * per, (end - first) * per

    def contains(self, addr: int, nbytes: int) -> bool:
        return self.base_addr <= addr and addr + nbytes <= self.base_addr + self.total_bytes

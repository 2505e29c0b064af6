"""The data side of the tiers: the host tensor, the disk file, and the
executor of a step's ordered block moves.

The host tier is a second block-major tensor ``[host_blocks, *block shape]``
on the CPU (pinned when the device is CUDA, so device <-> host copies are DMA
and can run asynchronously on the stream). Moves are executed in the order
decided, batched: each run of consecutive moves with the same (source tier,
destination tier) becomes one gather (``index_select``) and one scatter
(``index_copy_``), or one read / write of coalesced disk slots. A run is cut
where a move would read or overwrite a block an earlier move of the run
wrote, so batching never changes the result.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from engine.config import CacheConfig
from engine.kv_events import Tier
from engine.kv_pool import KVPool
from engine.tiers.cost import ThroughputMeter
from engine.tiers.disk import DiskStore
from engine.tiers.types import KVMove, TierSizes


def plan_tier_sizes(cache: CacheConfig, bytes_per_block: int) -> TierSizes:
    """Explicit block counts win; otherwise as many blocks as the byte budgets hold."""
    host = cache.num_host_blocks if cache.num_host_blocks is not None \
        else cache.host_kv_memory_bytes // bytes_per_block
    disk = cache.num_disk_blocks if cache.num_disk_blocks is not None \
        else cache.disk_kv_bytes // bytes_per_block
    if cache.disk_kv_bytes and not disk:
        raise ValueError(f"disk_kv_bytes ({cache.disk_kv_bytes} B) is smaller than one KV block "
                         f"({bytes_per_block} B): raise it")
    return TierSizes(host_blocks=host, disk_blocks=disk if cache.disk_kv_dir else 0)


@dataclass(frozen=True)
class MoveStats:
    """Cumulative data movement between tiers (device <-> device copies excluded)."""
    bytes_moved: int = 0
    blocks_moved: int = 0
    seconds: float = 0.0


def move_runs(moves: Sequence[KVMove]) -> Iterator[list[KVMove]]:
    """Consecutive moves with the same tiers, cut at a read-after-write or a
    write-after-write inside the run."""
    run: list[KVMove] = []
    written: set[tuple[Tier, int]] = set()
    for m in moves:
        if run and ((m.src_tier, m.dst_tier) != (run[0].src_tier, run[0].dst_tier)
                    or (m.src_tier, m.src) in written or (m.dst_tier, m.dst) in written):
            yield run
            run, written = [], set()
        run.append(m)
        written.add((m.dst_tier, m.dst))
    if run:
        yield run


class TierStorage:
    def __init__(self, kv_pool: KVPool, sizes: TierSizes, disk_dir: str = "") -> None:
        self.kv_pool = kv_pool
        self.sizes = sizes
        device = kv_pool.tensor.device
        pin = device.type == "cuda"
        self.host = torch.empty(kv_pool.block_shape(sizes.host_blocks), dtype=kv_pool.dtype,
                                pin_memory=pin)
        self.disk = DiskStore(disk_dir, sizes.disk_blocks, kv_pool.block_shape(1)[1:], kv_pool.dtype) \
            if sizes.disk_blocks else None
        # device <-> host bandwidth (bytes/s): probed now, then a running average of real moves
        self.bandwidth = ThroughputMeter()
        self._bytes = self._blocks = 0
        self._seconds = 0.0
        self._probe()

    @classmethod
    def from_cache_config(cls, cache: CacheConfig, kv_pool: KVPool) -> "TierStorage":
        return cls(kv_pool, plan_tier_sizes(cache, kv_pool.bytes_per_block), cache.disk_kv_dir)

    @property
    def stats(self) -> MoveStats:
        return MoveStats(self._bytes, self._blocks, self._seconds)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def apply(self, moves: Sequence[KVMove]) -> None:
        """Execute ``moves`` in order (batched per run)."""
        for run in move_runs(moves):
            src_tier, dst_tier = run[0].src_tier, run[0].dst_tier
            if src_tier is Tier.DEVICE and dst_tier is Tier.DEVICE:
                self.kv_pool.copy_blocks([(m.src, m.dst) for m in run])
                continue
            t0 = time.perf_counter()
            self._write(dst_tier, [m.dst for m in run], self._read(src_tier, [m.src for m in run]))
            if self.kv_pool.tensor.device.type == "cuda":
                torch.cuda.synchronize(self.kv_pool.tensor.device)
            seconds = time.perf_counter() - t0
            nbytes = len(run) * self.kv_pool.bytes_per_block
            self._bytes += nbytes
            self._blocks += len(run)
            self._seconds += seconds
            if Tier.DISK not in (src_tier, dst_tier):
                self.bandwidth.observe(nbytes, seconds)

    def _read(self, tier: Tier, ids: list[int]) -> torch.Tensor:
        if tier is Tier.DISK:
            return self._disk().read(ids)
        source = self.kv_pool.tensor if tier is Tier.DEVICE else self.host
        return source.index_select(0, torch.tensor(ids, dtype=torch.int64, device=source.device))

    def _write(self, tier: Tier, ids: list[int], data: torch.Tensor) -> None:
        if tier is Tier.DISK:
            self._disk().write(ids, data.cpu())
            return
        target = self.kv_pool.tensor if tier is Tier.DEVICE else self.host
        index = torch.tensor(ids, dtype=torch.int64, device=target.device)
        # non_blocking only towards the device: a CPU destination must be complete before it is read
        target.index_copy_(0, index, data.to(target.device, non_blocking=target.device.type != "cpu"))

    def _disk(self) -> DiskStore:
        if self.disk is None:
            raise ValueError("a move names the disk tier but none is configured: set disk_kv_dir and "
                             "disk_kv_bytes")
        return self.disk

    def _probe(self, max_blocks: int = 8, repeats: int = 3) -> None:
        """Seed the bandwidth average: copy a few device blocks to the host
        (reads only the device, so the pool's contents are untouched)."""
        n = min(max_blocks, self.sizes.host_blocks, self.kv_pool.num_blocks)
        if n == 0:
            return
        src = self.kv_pool.tensor[:n]
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.host[:n].copy_(src, non_blocking=True)
            if src.device.type == "cuda":
                torch.cuda.synchronize(src.device)
            self.bandwidth.observe(n * self.kv_pool.bytes_per_block, time.perf_counter() - t0)

"""EngineStats: what one engine reports about itself (polled by its worker)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner
    from engine.scheduler import Scheduler


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    waiting_tokens: int
    remote_waiting: int
    held: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    # tiers (cumulative counts except the *_blocks_used / *_total occupancy)
    kv_host_blocks_used: int = 0
    kv_host_blocks_total: int = 0
    kv_disk_blocks_used: int = 0
    kv_disk_blocks_total: int = 0
    kv_page_ins: int = 0               # cached blocks paged back into the device
    kv_page_outs: int = 0              # cached blocks moved down a tier
    kv_bytes_moved: int = 0            # between tiers, swaps included
    swap_preemptions: int = 0
    recompute_preemptions: int = 0
    # requests that waited for prompt blocks another request was computing (engine/prefix_wait.py)
    prefix_waits: int = 0
    prefix_wait_blocks_saved: int = 0  # in-flight blocks they then took as hits instead of computing


def tier_stats(scheduler: Scheduler, runner: ModelRunner) -> dict[str, int]:
    """The tier fields of EngineStats."""
    lower, counters = scheduler.kv.pool.lower, scheduler.kv.tier_counters
    return dict(kv_host_blocks_used=lower.host.num_used, kv_host_blocks_total=lower.host.num_slots,
                kv_disk_blocks_used=lower.disk.num_used, kv_disk_blocks_total=lower.disk.num_slots,
                kv_page_ins=counters.page_ins, kv_page_outs=counters.page_outs,
                kv_bytes_moved=runner.tiers.stats.bytes_moved,
                swap_preemptions=scheduler.num_swap_preemptions,
                recompute_preemptions=scheduler.num_recompute_preemptions)


def prefix_wait_stats(scheduler: Scheduler) -> dict[str, int]:
    """The prefix-wait fields of EngineStats."""
    w = scheduler.prefix_waits.stats
    return dict(prefix_waits=w.waits, prefix_wait_blocks_saved=w.blocks_saved)

"""KV cache tiers below the device: host DRAM and disk (see docs/tiering.md)."""
from engine.tiers.types import KVMove, MoveLog, SwapRecord, TierCounters, TierEntry, TierSizes

__all__ = ["KVMove", "MoveLog", "SwapRecord", "TierCounters", "TierEntry", "TierSizes"]

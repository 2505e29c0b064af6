"""Preemption by swap or by recompute: a per-request cost rule.

Swapping moves the request's blocks to the host tier and back (bytes at the
measured device <-> host bandwidth, both ways); recomputing runs its
computed tokens through the model again (tokens at the measured prefill
speed). Both speeds are running averages the engine keeps up to date;
``preemption_mode`` can force either choice.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PreemptionMode(str, Enum):
    AUTO = "auto"
    SWAP = "swap"
    RECOMPUTE = "recompute"

    @classmethod
    def parse(cls, value: "str | PreemptionMode") -> "PreemptionMode":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"preemption_mode must be one of {', '.join(m.value for m in cls)}, "
                             f"got {value!r}") from None


class ThroughputMeter:
    """Exponentially weighted running average of a rate (units per second)."""

    def __init__(self, alpha: float = 0.3, initial: float | None = None) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.rate = initial
        self.samples = 0

    def observe(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        r = amount / seconds
        self.rate = r if self.rate is None else (1 - self.alpha) * self.rate + self.alpha * r
        self.samples += 1


@dataclass(frozen=True)
class PreemptionCost:
    swap_seconds: float | None        # None: unknown bandwidth (no host tier measured)
    recompute_seconds: float | None   # None: unknown prefill speed

    @property
    def prefers_swap(self) -> bool:
        if self.swap_seconds is None:
            return False
        return self.recompute_seconds is None or self.swap_seconds < self.recompute_seconds


def preemption_cost(num_blocks: int, bytes_per_block: int, num_tokens: int,
                    bandwidth: float | None, prefill_tokens_per_s: float | None) -> PreemptionCost:
    """Pure: seconds to swap ``num_blocks`` out and back in vs to recompute ``num_tokens``."""
    swap = 2 * num_blocks * bytes_per_block / bandwidth if bandwidth else None
    recompute = num_tokens / prefill_tokens_per_s if prefill_tokens_per_s else None
    return PreemptionCost(swap, recompute)


class PreemptionPolicy:
    """Chooses swap or recompute for one victim. The default never swaps."""

    def __init__(self, mode: PreemptionMode | str = PreemptionMode.RECOMPUTE, bytes_per_block: int = 0,
                 bandwidth: ThroughputMeter | None = None, prefill: ThroughputMeter | None = None) -> None:
        self.mode = PreemptionMode.parse(mode)
        self.bytes_per_block = bytes_per_block
        self.bandwidth = bandwidth or ThroughputMeter()
        self.prefill = prefill or ThroughputMeter()
        self.last_cost: PreemptionCost | None = None

    def choose(self, num_blocks: int, num_tokens: int) -> PreemptionMode:
        if self.mode is not PreemptionMode.AUTO:
            return self.mode
        self.last_cost = preemption_cost(num_blocks, self.bytes_per_block, num_tokens,
                                         self.bandwidth.rate, self.prefill.rate)
        return PreemptionMode.SWAP if self.last_cost.prefers_swap else PreemptionMode.RECOMPUTE

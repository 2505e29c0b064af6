"""The price of a reclaim: what a worker decode gives prefill at the fleet cap is worth once the
controller's own KV-room rule may take it back.

    price = reclaim_price(memory, workers=D, removed=k)
    trade while saving x price.kept_s > price.risk

Decode gives its k-th worker (down to D - k); the KV-room rule grows decode back as soon as its
KV demand passes what D - k workers hold at the KV target, displacing a prefill worker (decode
first at the cap), and the new decode worker is ready one start-up later. Against keeping the
worker, the trade gains prefill's saving from when its new worker is ready (one start-up after
the trade) until the reclaim, and costs decode's demand over the target from the crossing until
decode's new worker is ready (before the crossing the demand fits under the target, after the
window decode is whole again). Prefill's drain at the reclaim loses the saving at once (the
drained worker takes no new prompt): the kept time ends at the crossing, not when decode is
whole. Every term comes from the controller's memory of decode's KV demand or its constants:

- ``e``: the times the remembered demand went over (D - k) x target from under it (a run of
  samples over counts once): the crossings the KV-room rule would have answered;
- the reclaim comes after an exponential time at the rate lambda = e / the span the memory
  covers (memoryless: the memory says how often, not when); over a horizon H (the memory's
  length: what the evidence covers) the worker is kept E[(min(T, H) - s)+] =
  (exp(-lambda s) - exp(-lambda H)) / lambda seconds after its start-up s (H - s when e = 0), and
  a reclaim comes with probability 1 - exp(-lambda H);
- the window's risk: at each remembered crossing, the demand in the k-th worker's band over the
  target (what D - k + 1 workers would hold and D - k not) for the samples within one start-up
  of it, as a part of the mean demand, times the sample spacing: the requests (part x seconds)
  over the target while decode waits for its worker; its mean over the crossings, times the
  reclaim's probability. A sequence over the target counts as at risk, as in the trade's cost
  (trade.py): the target is decode's margin and where this controller regrows.

The sample spacing is the memory's own (its span over its samples); the start-up is the
controller's forecast horizon (``predict_ahead_s``), the horizon its memory
(``scale_in_memory_factor`` x ``scale_in_hold_s``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeMemory:
    """Decode's remembered KV demand, (time, worker units), oldest first, the last one now."""
    samples: tuple[tuple[float, float], ...]
    target_kv: float
    startup_s: float
    horizon_s: float

    def __post_init__(self) -> None:
        if self.startup_s < 0 or self.horizon_s <= 0 or not 0 < self.target_kv <= 1:
            raise ValueError(f"decode memory: need startup_s >= 0, horizon_s > 0 and 0 < target_kv <= 1, got "
                             f"{self.startup_s}, {self.horizon_s}, {self.target_kv}")

    @property
    def spacing_s(self) -> float:
        """Seconds between samples (the caller's interval, as the memory saw it)."""
        n = len(self.samples)
        return (self.samples[-1][0] - self.samples[0][0]) / (n - 1) if n > 1 else self.startup_s or 1.0


@dataclass(frozen=True)
class ReclaimPrice:
    crossings: int      # times the memory went over what D - k hold at the target
    kept_s: float       # expected seconds prefill serves with the moved worker within the horizon
    chance: float       # probability the KV-room rule takes it back within the horizon
    risk: float         # expected requests (part x seconds) over the target in the reclaim's window


def crossings(samples: tuple[tuple[float, float], ...], room: float) -> tuple[int, ...]:
    """Indices where the demand went over ``room`` (a run of samples over counts once)."""
    out, over = [], False
    for i, (_, x) in enumerate(samples):
        if x > room and not over:
            out.append(i)
        over = x > room
    return tuple(out)


def reclaim_price(memory: DecodeMemory, workers: int, removed: int) -> ReclaimPrice:
    """What taking the ``removed``-th worker from ``workers`` costs and how long it stays away."""
    samples, t, s, h = memory.samples, memory.target_kv, memory.startup_s, memory.horizon_s
    if not samples or workers - removed <= 0:
        return ReclaimPrice(0, 0.0, 1.0, math.inf)
    room = (workers - removed) * t
    starts = crossings(samples, room)
    if not starts:
        return ReclaimPrice(0, max(0.0, h - s), 0.0, 0.0)
    spacing = memory.spacing_s
    rate = len(starts) / (len(samples) * spacing)
    kept = (math.exp(-rate * s) - math.exp(-rate * h)) / rate
    chance = 1.0 - math.exp(-rate * h)
    mean = sum(x for _, x in samples) / len(samples)
    window = 0.0
    for i in starts:
        t0 = samples[i][0]
        window += sum(max(0.0, x - room) - max(0.0, x - room - t) for ts, x in samples[i:] if ts < t0 + max(s, spacing))
    return ReclaimPrice(len(starts), max(0.0, kept), chance, chance * window * spacing / mean / len(starts))

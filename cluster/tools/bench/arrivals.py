"""When requests are sent: open-loop arrival schedules, seeded.

- poisson: exponential gaps with mean 1/rate.
- gamma: gamma gaps with shape = burstiness and mean 1/rate. burstiness 1 is
  Poisson; below 1 arrivals bunch up (gap CV = 1/sqrt(burstiness)), above 1
  they are more even.
- fixed: exactly 1/rate apart.
- rate inf: every request at t = 0 (all at once).

A schedule is a list of offsets in seconds from the start, first one at 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PROCESSES = ("poisson", "gamma", "fixed")


@dataclass(frozen=True)
class ArrivalSpec:
    rate: float = math.inf             # requests per second
    process: str = "poisson"
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.process not in PROCESSES:
            raise ValueError(f"arrival process must be one of {', '.join(PROCESSES)}, got {self.process!r}")
        if not self.rate > 0:
            raise ValueError(f"--request-rate must be > 0 requests/s (or inf for all at once), got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0 (1 = Poisson, < 1 burstier), got {self.burstiness}")
        if self.process == "poisson" and self.burstiness != 1.0:
            raise ValueError(f"--burstiness {self.burstiness} shapes gamma arrivals: add --arrival gamma "
                             "(Poisson is gamma with burstiness 1)")

    @classmethod
    def from_flags(cls, rate: float, process: str | None, burstiness: float) -> "ArrivalSpec":
        """--arrival unset: gamma when a burstiness other than 1 is given, else poisson."""
        if process is None:
            process = "gamma" if burstiness != 1.0 else "poisson"
        return cls(rate, process, burstiness)

    def describe(self) -> str:
        if math.isinf(self.rate):
            return "all at once"
        extra = f", burstiness {self.burstiness:g}" if self.process == "gamma" else ""
        return f"{self.process} at {self.rate:g} req/s{extra}"


def schedule(spec: ArrivalSpec, n: int, seed: int) -> list[float]:
    """n send offsets in seconds, non-decreasing, the first at 0."""
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if n == 0:
        return []
    if math.isinf(spec.rate):
        return [0.0] * n
    mean = 1.0 / spec.rate
    rng = np.random.default_rng(seed)
    if spec.process == "fixed":
        gaps = np.full(n - 1, mean)
    elif spec.process == "poisson":
        gaps = rng.exponential(mean, size=n - 1)
    else:
        gaps = rng.gamma(spec.burstiness, mean / spec.burstiness, size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()

"""At the fleet cap: how many workers decode gives to prefill, by marginal value.

    k = workers_to_trade(prefill, decode, ...)

Pure functions, no state: the controller keeps the decode pool's recent KV demand
(`ControllerState`'s ``decode.kv_demand``) and calls this when prefill asks for more
workers and both pools together are at the cap. One worker moves from decode to
prefill when what it saves there is worth more than what it costs here, both as a
part of the requests:

- **What one more prefill worker saves**: the TTFT misses by waiting over the
  budget (the measured wait-miss fraction ``m`` above ``ttft_miss_budget``) that
  W + 1 workers would not have. Each prefill worker is a queue (prefix-aware
  routing keeps a prompt on the nodes that hold its prefix) at utilisation
  rho = predicted prompt tokens/s / (W x one worker's tokens/s, the planner's
  capacity figure). An M/M/1 queue waits longer than a slack t with probability
  rho x exp(-mu t (1 - rho)); calibrated on the measured ``m`` (mu t =
  -ln(m / rho) / (1 - rho), no constant fitted), W + k workers at rho' = rho x W /
  (W + k) miss rho' x exp(-mu t (1 - rho')). Where the queue model cannot hold the
  measurement (m >= rho, or rho >= 1), misses scale with rho.
  **Measured convexity** (save33): the window's mean rho hides the bursts inside
  it where the misses come from, so the M/M/1 tail at the mean is too flat where
  misses concentrate at high load. Over the memory the controller also keeps each
  interval's own (rho, m); the least-squares slope of ln m on ln rho there, b, is
  how steeply this fleet's misses follow its load (`miss_elasticity`). W + k
  workers then miss m x (W / (W + k))^b, and the estimate takes the larger of the
  two drops (the fitted slope is noisy and biased low by the noise in rho, so it
  only raises the queue model's figure: `prefill_miss_after`'s ``elasticity``).
- **What one fewer decode worker costs**: the part of decode's KV demand that
  D - 1 workers would hold above the KV target, over decode's recent samples
  (the last ``scale_in_memory_factor`` holds, the current one at the predicted
  load). A sample's demand is KV in worker units: mean KV use (reserved blocks
  included) x ready workers + waiting / sequences per worker. Every sequence
  above the target counts as a request at risk (the target is the margin that
  keeps decode off its cliff: a full worker makes hand-offs wait and every ITL
  stretch). Weighted by demand, so a burst's samples weigh what they hold.

Both sides use only the model's figures (one prefill worker's tokens/s, the
sequences one decode worker holds, the KV target, the miss budget) and what the
controller measured; the k-th worker moves only while its saving exceeds its cost
(both fall off with k), and never below what decode asks for itself.
"""
from __future__ import annotations

import math


def miss_elasticity(samples: tuple[tuple[float, float], ...]) -> float | None:
    """How steeply the wait-miss fraction follows utilisation over recent intervals: the
    least-squares slope of ln(miss) on ln(rho) over the (rho, miss) samples with both
    positive (an interval without a miss says nothing about the slope of its logarithm).
    None with fewer than two such samples or no spread in rho."""
    pts = [(math.log(r), math.log(m)) for r, m in samples if r > 0 and m > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx <= 1e-12:
        return None
    return sum((x - mx) * (y - my) for x, y in pts) / sxx


def prefill_miss_after(miss: float, rho: float, workers: int, added: int,
                       elasticity: float | None = None) -> float:
    """The wait-miss fraction with ``added`` more workers, from ``miss`` measured at
    utilisation ``rho`` on ``workers`` (M/M/1 per worker, calibrated on ``miss``); with the
    measured ``elasticity`` b (`miss_elasticity`), the lower of that and miss x (W / (W + k))^b."""
    if miss <= 0 or rho <= 0 or workers <= 0:
        return max(0.0, miss)
    after = rho * workers / (workers + added)
    if rho >= 1 or miss >= rho:
        queue = miss * after / rho
    else:
        mu_t = -math.log(miss / rho) / (1 - rho)
        queue = min(miss, after * math.exp(-mu_t * (1 - after)))
    if elasticity is None or elasticity <= 0:
        return queue
    return min(queue, miss * (workers / (workers + added)) ** elasticity)


def prefill_saving(miss: float, budget: float, rho: float, workers: int, added: int,
                   elasticity: float | None = None) -> float:
    """The part of the requests the ``added``-th more prefill worker keeps within the TTFT
    target (misses over the budget only: the budget is what the operator allows)."""
    before = max(0.0, prefill_miss_after(miss, rho, workers, added - 1, elasticity) - budget)
    return before - max(0.0, prefill_miss_after(miss, rho, workers, added, elasticity) - budget)


def decode_cost(demand: tuple[float, ...], workers: int, removed: int, target_kv: float) -> float:
    """The part of decode's KV demand (sequences, weighted by what each sample holds) that
    ``workers - removed`` would hold above the KV target and ``workers - removed + 1`` not."""
    total = sum(demand)
    if total <= 0:
        return 0.0
    room_after, room_before = (workers - removed) * target_kv, (workers - removed + 1) * target_kv
    if room_after <= 0:
        return math.inf
    over = sum(max(0.0, x - room_after) - max(0.0, x - room_before) for x in demand)
    return over / total


def workers_to_trade(miss: float, budget: float, rho: float, prefill_workers: int,
                     demand: tuple[float, ...], decode_workers: int, decode_floor: int, target_kv: float,
                     step: int, elasticity: float | None = None) -> int:
    """How many workers decode gives to prefill (at most ``step``, never below ``decode_floor``):
    the k-th only while one more prefill worker saves more requests than one fewer decode
    worker puts at risk."""
    k = 0
    while k < step and decode_workers - k - 1 >= decode_floor:
        saving = prefill_saving(miss, budget, rho, prefill_workers, k + 1, elasticity)
        if saving <= 0 or saving <= decode_cost(demand, decode_workers, k + 1, target_kv):
            break
        k += 1
    return k

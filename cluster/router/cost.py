"""The routing cost: pure functions, no state, unit-tested on their own.

Every cost is in the same unit, *token-equivalents of prefill work*, so that
prefill and decode terms can be added (colocated mode) and compared:

- a prefill node costs its uncached prompt tokens (the work this request adds)
  plus the tokens already queued for prefill on it (the wait before it starts).
  An uncached token weighs ``uncached_token`` = 6 queued tokens, not 1. A
  miss is computed now; it then sits in that node's queue ahead of every
  later request (near capacity each of those waits about as long again), and
  its blocks evict prefixes other requests would hit. A node's reported queue
  also counts waiting requests' whole prompts, hits included, so it overstates
  the wait at a prefix holder. At 1 : 1 the router left a busy holder as soon
  as its queue passed the prefix's length and recomputed the prefix
  elsewhere, which under load fed the queues it was avoiding (0.75 / 0.59 of
  the ideal hit rate in benchmarks/routing.py). At 6 a holder keeps its
  group until its queue is six prefixes longer than another node's; 3 to 8
  keep the shared-prefix workload at its ideal hit rate in the simulator,
  6 and 8 also the Mooncake replay (>= 0.95 of ideal in 11 of 12 runs;
  sweep in docs/benchmarks.md). When every prefill node has queued tokens
  (a pool busy everywhere) a miss weighs ``busy_pool_miss`` = 4 times that:
  with no idle node, the recomputed tokens use no spare capacity; they add
  to a backlog that every later request of the pool waits through, for as
  long as the pool stays busy, not only the chosen node's queue. A holder
  then keeps its turn until its queue is 24 prefixes longer than another
  node's. The Mooncake replay at its knee (block 64) left holders six
  prefixes busier and fell to 0.944 of the ideal hit rate; in the simulator
  2 to 12 raise its hit rate and lower its mean TTFT, gains flattening from
  4, with shared-prefix unchanged; measured, 0.942-0.947 against main's
  0.924-0.933 in the same hour ("moon33" in docs/benchmarks.md);
- a decode node costs its running sequences and KV usage, each scaled to
  token-equivalents by a weight, plus the blocks it would have to pull.

Placing a new conversation by a short shared prefix feeds one node. Most prompts
of a trace may share a block or two (a common system preamble): the nodes that
computed it first are then cheaper for every later new conversation by that
block's miss, however idle the others are, and the conversations' later turns
follow them home; in the simulator (docs/benchmarks.md, seeds46) one of four
prefill nodes got no request at all on two samples of ten. With ``min_hit_share``
> 0 a prefill node's hit under that share of the prompt counts as none (SGLang's
cache-aware router has the same kind of threshold): such a conversation is placed
by queue and the tie rule, while a later turn, whose hit is most of its prompt,
still goes home. The C decider applies it too (decide.c), so it costs no decision
time. Off by default (0): in the simulator it lowers prefix-aware's TTFT p90 by 14-18%;
in real runs, side by side on two samples, by 7% and 13%, while the p99 rose by 24% and
9% (docs/benchmarks.md, floor47): a trade left to the user.

A block cached on the host or disk tier counts as a fraction of a device hit
(``host_hit`` / ``disk_hit``): reading it back is cheaper than recomputing but
not free. Selection is argmin at temperature 0 (ties go to the first
candidate, so callers pass candidates in a stable order) and a softmax over
normalised costs above it, with an injected ``random.Random``.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Iterable, Sequence


@dataclass(frozen=True, slots=True)
class CostWeights:
    uncached_token: float = 6.0    # per prompt token a node must compute (a miss: see the module doc)
    queued_token: float = 1.0      # per token already queued for prefill on that node
    running: float = 32.0          # token-equivalents per running decode sequence
    kv_usage: float = 512.0        # token-equivalents at 100% KV usage (linear)
    transfer_block: float = 1.0    # per block a decode node must pull from the prefill node
    host_hit: float = 0.8          # a host-tier hit is worth this share of a device hit
    disk_hit: float = 0.5          # a disk-tier hit is worth this share of a device hit
    in_flight_hit: float = 0.9     # a block sent to the node, not yet reported, is worth this share
    busy_pool_miss: float = 4.0    # uncached_token x this when every prefill node has a queue
    min_hit_share: float = 0.0     # a prefill node's hit under this share of the prompt counts as none (0: off)

    def __post_init__(self) -> None:
        for name in ("uncached_token", "queued_token", "running", "kv_usage", "transfer_block"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostWeights.{name} must be >= 0 (0 disables that term), "
                                 f"got {getattr(self, name)}")
        if not self.busy_pool_miss >= 1.0:
            raise ValueError(f"CostWeights.busy_pool_miss multiplies the miss weight on a pool busy "
                             f"everywhere: give a value >= 1 (1 turns it off), got {self.busy_pool_miss}")
        if not 0.0 <= self.min_hit_share < 1.0:
            raise ValueError(f"CostWeights.min_hit_share is the share of a prompt a prefill node's cached prefix must "
                             f"cover to count: give a value in [0, 1) (0: every hit counts), got {self.min_hit_share}")
        for name in ("host_hit", "disk_hit", "in_flight_hit"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"CostWeights.{name} is a share of a device hit: give a value "
                                 f"in [0, 1], got {getattr(self, name)}")


def effective_cached_blocks(device_blocks: int, host_blocks: int, disk_blocks: int,
                            weights: CostWeights, in_flight_blocks: int = 0) -> float:
    """Cached prefix blocks, a host, disk or in-flight hit weighing less than a device hit."""
    return (device_blocks + weights.host_hit * host_blocks + weights.disk_hit * disk_blocks
            + weights.in_flight_hit * in_flight_blocks)


def prefill_cost(uncached_blocks: float, queued_prefill_tokens: int, block_size: int,
                 weights: CostWeights, in_flight_blocks: int = 0) -> float:
    """Cost of prefilling on a node: new work plus the queue ahead of it.

    ``in_flight_blocks`` of this prompt were sent to the node and are not yet
    reported: the queue ahead is (up to) computing them, a wait that replaces
    computing them here, so that much of the queue is not counted. A burst of
    requests sharing a prefix thus stays on the node computing it until the
    rest of its queue outweighs the prefix.
    """
    if uncached_blocks < 0 or queued_prefill_tokens < 0 or in_flight_blocks < 0:
        raise ValueError(f"uncached_blocks ({uncached_blocks}), queued_prefill_tokens "
                         f"({queued_prefill_tokens}) and in_flight_blocks ({in_flight_blocks}) "
                         "must be >= 0")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    queued = queued_prefill_tokens - in_flight_blocks * block_size if in_flight_blocks else queued_prefill_tokens
    return (weights.uncached_token * uncached_blocks * block_size
            + weights.queued_token * max(0, queued))


def busy_pool(queued_prefill_tokens: Iterable[int]) -> bool:
    """Every prefill node has tokens queued (the miss weight is then ``busy_pool_miss`` x)."""
    return all(q > 0 for q in queued_prefill_tokens)


def busy_weights(weights: CostWeights) -> CostWeights:
    """``weights`` with the miss weight of a pool busy everywhere."""
    return replace(weights, uncached_token=weights.uncached_token * weights.busy_pool_miss)


def decode_cost(running: int, kv_usage: float, weights: CostWeights) -> float:
    """Cost of adding one more sequence to a decode node's batch."""
    if running < 0 or kv_usage < 0:
        raise ValueError(f"running ({running}) and kv_usage ({kv_usage}) must be >= 0; "
                         "kv_usage is used / total blocks")
    return weights.running * running + weights.kv_usage * kv_usage


def transfer_cost(missing_blocks: float, weights: CostWeights) -> float:
    """Cost of the blocks a decode node lacks and must pull from the prefill node."""
    if missing_blocks < 0:
        raise ValueError(f"missing_blocks must be >= 0, got {missing_blocks}")
    return weights.transfer_block * missing_blocks


def decode_node_cost(running: int, kv_usage: float, missing_blocks: float,
                     queued_prefill_tokens: int, weights: CostWeights) -> float:
    """Cost of picking a decode node in disaggregated mode, in one call (hot path):
    ``decode_cost + transfer_cost(missing) + prefill_cost(0, queued)``."""
    if running < 0 or kv_usage < 0 or missing_blocks < 0 or queued_prefill_tokens < 0:
        raise ValueError(f"running ({running}), kv_usage ({kv_usage}), missing_blocks "
                         f"({missing_blocks}) and queued_prefill_tokens ({queued_prefill_tokens}) "
                         "must be >= 0")
    return (weights.running * running + weights.kv_usage * kv_usage
            + weights.transfer_block * missing_blocks + weights.queued_token * queued_prefill_tokens)


def should_prefill_locally(uncached_tokens_on_decode: int, prompt_tokens: int,
                           decode_hit_ratio: float, threshold: int, hit_ratio: float) -> bool:
    """Conditional disaggregation: the decode node prefills itself when what it
    lacks is short (at or below ``threshold`` tokens) or it already holds at
    least ``hit_ratio`` of the prompt."""
    if not 0 <= uncached_tokens_on_decode <= prompt_tokens:
        raise ValueError(f"uncached_tokens_on_decode ({uncached_tokens_on_decode}) must be "
                         f"between 0 and prompt_tokens ({prompt_tokens})")
    if not 0.0 <= decode_hit_ratio <= 1.0 or not 0.0 <= hit_ratio <= 1.0:
        raise ValueError(f"decode_hit_ratio ({decode_hit_ratio}) and hit_ratio ({hit_ratio}) "
                         "are shares of the prompt: give values in [0, 1]")
    if threshold < 0:
        raise ValueError(f"threshold is a token count: give a value >= 0, got {threshold}")
    return uncached_tokens_on_decode <= threshold or decode_hit_ratio >= hit_ratio


def select(costs: Sequence[float], temperature: float, rng: random.Random, start: int = 0) -> int:
    """Index of the chosen candidate.

    Temperature 0: the lowest cost, ties to the first index at or after
    ``start``, wrapping round (no randomness used; ``start`` 0: the lowest
    index). Above 0: softmax over costs normalised to [0, 1] by their range, so
    the temperature means the same thing whatever the cost scale; p_i is
    proportional to exp(-(c_i - min) / (range * temperature)).
    """
    if not costs:
        raise ValueError("select() needs at least one candidate cost")
    if temperature < 0 or math.isnan(temperature):
        raise ValueError(f"temperature must be >= 0 (0 = argmin), got {temperature}")
    lo = min(costs)
    if temperature == 0:
        if 0 < start < len(costs):
            try:
                return costs.index(lo, start)
            except ValueError:
                pass
        return costs.index(lo)
    span = max(costs) - lo
    if span <= 0:
        return rng.randrange(len(costs))
    scale = 1.0 / (span * temperature)
    weights = [math.exp((lo - c) * scale) for c in costs]
    return softmax_pick(weights, rng)


def softmax_pick(weights: Sequence[float], rng: random.Random) -> int:
    """Sample an index with probability proportional to ``weights`` (all >= 0, one > 0)."""
    r = rng.random() * sum(weights)
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if r < acc:
            return i
    return len(weights) - 1

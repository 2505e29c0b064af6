"""The autoscaling controller: a pure decision per interval for the prefill and
decode pools.

    decision, state = decide(config, signals, state, now)

No I/O, no clock, no globals: the caller (the live head, or the simulator on its
virtual clock) builds `FleetSignals` each interval, keeps the returned
`ControllerState`, and acts on `FleetDecision` (start ``target - current``
workers, or drain ``current - target``). Its next ``signals.*.workers`` is the
target it acted on (starting workers included).

Which signals decide each pool, and why:

- **Prefill** serves prompt tokens, so its load is a token rate. Workers needed
  = predicted prompt tokens/s / (what one worker sustains x
  ``target_utilization``) + queued tokens / (``queue_drain_fraction`` x TTFT
  target) / (one worker's raw tokens/s x ``target_utilization``). The rate
  term keeps up with arrivals; the queue term clears a backlog fast enough that
  the requests in it still meet the TTFT target (a queue of Q tokens on W
  workers waits Q / (W x capacity) seconds before its last prompt starts). The
  queue counts only while TTFT p90 misses its target: a burst that TTFT absorbs
  is no reason to grow, and with prefix-aware routing a backlog sits on the
  nodes that hold its prefix, which new workers do not relieve. TTFT p90 above
  target while tokens queue grows the pool by the relative miss (at least one
  worker, at most a step) even if the model says it is big enough; the pool
  shrinks only while the p90 is well under target (``slo_scale_in_margin``).
  TTFT is prefill's SLO alone: a decode pool without room delays the hand-off,
  not the first token. When the caller measures it, the **wait-miss fraction**
  replaces the TTFT p90 in all of this: of the requests whose prefill alone
  (no queueing) fits the TTFT target, the part that missed it. A p90 over target
  can come from prompts too long to meet it on an idle worker (then more workers
  are waste), and a p90 under target still lets a tenth of the requests miss.
  Above ``ttft_miss_budget`` the backlog counts and the pool grows by
  ``ttft_miss_gain`` x the relative excess (at least one worker, at most a
  step); it shrinks only while the fraction is under ``slo_scale_in_margin`` x
  the budget.
- **Decode** serves concurrent sequences, bounded by KV room, so its load is
  the sequences it holds (running + waiting) against what one worker holds, and
  the KV blocks in use (measured, so it also sees long contexts the
  per-worker figure underestimates) plus what the waiting will take once
  admitted (waiting / the per-worker figure: a backlog waiting for room is not
  in the KV use yet, and the mean KV use hides the full nodes it waits on). Requests waiting while KV is above its
  target mean no room now: at least one more worker (KV_ROOM); waiting with
  room to spare is a batch slot a step away, counted as load only. ITL p90
  above target grows the pool by the relative miss (a large batch slows every
  step, and a hand-off waiting for room shows up as a long first gap); it
  shrinks only while the ITL p90 is well under target, and not while hand-offs
  wait and a worker reports KV use at or over its target
  (``DecodeSignals.kv_usage_by_worker``, `waits_on_full`): the waiting sit on
  full workers whatever the mean says (at 1000 simulated nodes 60-76 waited
  while the mean read 0.4-0.6), and a shrink drains the least-loaded workers,
  the ones with room. **At the fleet cap** the load and KV-room rules grow decode only
  past ``decode_grow_usage_at_cap`` (0.95) of what it holds, not past the targets: a
  decode worker more there is a prefill worker fewer, so decode rides a burst nearly
  full, as a fixed split does, rather than buying headroom with prefill's TTFT (the
  simulator's 100- and 1000-node fleets, docs/simulator.md "(grow36)"). The targets still
  size its scale-in, its trades and the start split; ITL misses still grow it at once.

Load is predicted ``predict_ahead_s`` ahead (about a worker's start-up time):
the last observation plus the smoothed slope (an EWMA of the EWMA's slope) times
the horizon. Scale-out uses the larger of the last observation and the
prediction (react at once to a step and to a ramp, but not to a spike already
falling); scale-in the largest of observation, EWMA and prediction (leave
slowly: the EWMA remembers a recent peak).

The per-worker capacity figures are the caller's model; what a worker sustains
*within the SLO* can be less (TTFT needs short queues behind long prompts). So
each pool keeps a learned ``capacity_scale``: an SLO miss at a size the figure
said was enough lowers it so the figure asks for the grown size, and it
recovers toward 1 by ``capacity_recovery_per_s`` while the SLO holds with
margin; shrinking then has to wait until the recovered figure says the load
fits in fewer workers.

**Prefill shrinks slowly**: its scale-in waits ``prefill_hold_factor`` holds (5 x 60 s
by default), as its size is set by the TTFT tail (long prompts queued behind each other
on the nodes that hold their prefix), which the token-rate test of the scale-in does not
see: at 20% of its token capacity a prefill pool can still be short for TTFT.

**At the fleet cap**, when prefill asks for more and decode does not need all it holds,
decode gives way at once (``trade_at_cap``): its scale-in skips the hold (a step per
cool-down still) and prefill grows into the room. What keeps decode from giving too much
is the **memory of peaks**: no pool shrinks below the most it needed at the scale-in level
(sequences at ``scale_in_utilization``, KV at ``scale_in_kv_usage``) at any interval of
the last ``scale_in_memory_factor`` holds (3 x 60 s), longer than the hold itself, so the
quiet minute before a rise does not set its size. When the caller measures the wait-miss fraction,
the trade is decided by **marginal value** instead (`trade.py`): decode gives the k-th worker only
while what one more prefill worker saves in TTFT misses over the budget (an M/M/1 queue per worker at
the planner's tokens/s, calibrated on the measured fraction; or, where steeper, the slope of the misses
against the utilisation over the memory's intervals, ``PoolState.miss_load``) exceeds what one fewer decode worker
puts at risk (the part of decode's KV demand over the memory, the current interval at the predicted
load, that the rest would hold above the KV target), never below decode's own ask at the target,
a step per cool-down, and only once the memory of peaks is full (its evidence is the memory).

**The first hold**: nothing shrinks (nor gives way at the fleet cap) before the controller has
watched the pool for one ``scale_in_hold_s``: the memory of peaks that bounds every shrink has
seen nothing yet, and the first intervals of a start are the least typical (every client's
first prompt at once). The start split has to be right for that long (the planner's
`split_at_cap`).

**Idle**: no prompt tokens arrived and none queued for ``idle_hold_s``: neither pool
gets new work, and more workers cannot speed up what runs (a running sequence does not
move), so both pools drain to their minimum at once instead of a step per cool-down;
the drained workers finish what they hold. Not the decode pool while hand-offs wait
there for a batch slot: a drain would send them to the workers that stay, behind their
own queues, where more workers start them sooner (orchestration/rebalance.py moves them
to free slots); it shrinks by the ordinary rules, or once nothing waits. This is where an autoscaled fleet stops
paying for a fixed fleet's idle tail. With ``PrefillSignals.since_last_prompt_s`` the lull
counts from the last prompt's arrival (a rate over a window would report it a window late).

Against flapping: a hysteresis band (scale out above ``target_utilization``,
scale in only when the load fits at ``scale_in_utilization`` in fewer workers
and the SLO p90 is under ``slo_scale_in_margin`` of target, and only after that
held for ``scale_in_hold_s``; a shrink goes no lower than the most workers the
load needed at any interval of that hold, so a bursty load's quiet sample does
not set the size), cool-downs (no further scale-out for ``cooldown_out_s`` after one, no
scale-in for ``cooldown_in_s`` after any change), step limits, and bounds (per
pool, and optionally for both pools together: growth shared by the asks, or
with ``decode_first_under_cap`` decode's first, displacing prefill workers if it
must, since a decode pool without KV room is a cliff and a short prefill pool
only queues). Workers still draining (``FleetSignals.draining``) count against
the fleet cap: they hold a GPU until they leave.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from cluster.orchestration.autoscale.signals import (AutoscaleConfig, DecodeSignals, FleetSignals, PoolBounds,
                                                     PrefillSignals)
from cluster.orchestration.autoscale.trade import miss_elasticity, workers_to_trade

_NEVER = float("-inf")


class Reason(str, enum.Enum):
    LOAD = "load"            # predicted load needs more workers (prefill tokens/s, decode sequences)
    QUEUE = "queue"          # the prefill backlog must drain within the TTFT target
    TTFT_SLO = "ttft_slo"    # TTFT p90 over target while prompts queue
    KV_ROOM = "kv_room"      # decode KV use, or requests waiting for room
    ITL_SLO = "itl_slo"      # ITL p90 over target
    IDLE = "idle"            # load below the scale-in threshold for the hold time: shrink
    TRADE = "trade"          # at the fleet cap, decode gives workers to prefill (marginal value, trade.py)
    COOLDOWN = "cooldown"    # a change is wanted but the last one is too recent
    AT_MAX = "at_max"        # more wanted, the pool (or fleet) is at its maximum
    AT_MIN = "at_min"        # fewer wanted, the pool is at its minimum
    STEADY = "steady"        # within the band (or below it, not yet for long enough)


GROW = frozenset({Reason.LOAD, Reason.QUEUE, Reason.TTFT_SLO, Reason.KV_ROOM, Reason.ITL_SLO})


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    current: int
    target: int
    reason: Reason
    needed: int               # workers the predicted load needs at the target utilisation (unbounded)
    predicted_load: float     # prefill: prompt tokens/s; decode: sequences

    @property
    def delta(self) -> int:
        return self.target - self.current


@dataclass(frozen=True)
class FleetDecision:
    prefill: PoolDecision
    decode: PoolDecision

    @property
    def pools(self) -> tuple[PoolDecision, PoolDecision]:
        return self.prefill, self.decode


@dataclass(frozen=True)
class PoolState:
    ewma: float | None = None        # smoothed load
    trend: float = 0.0               # smoothed d(load)/dt, per second
    last_t: float | None = None      # time of the last observation
    last_out_t: float = _NEVER       # time of the last scale-out
    last_change_t: float = _NEVER    # time of the last change either way
    below_since: float | None = None  # the load has fit in fewer workers since then
    # (time, workers the load needed at the scale-in utilisation) over the last scale_in_hold_s while below
    needs: tuple[tuple[float, int], ...] = ()
    # what one worker really sustains within the SLO, as a part of the caller's capacity figure:
    # lowered when the SLO missed at a size the figure said was enough, recovering slowly while
    # the SLO holds with margin
    capacity_scale: float = 1.0
    # (time, workers the load needed at the scale-in level) at every interval of the last
    # scale_in_memory_factor x scale_in_hold_s: no shrink goes below its most
    peaks: tuple[tuple[float, int], ...] = ()
    first_t: float | None = None     # the first observation: the memory of peaks starts here
    # decode: (time, KV demand in worker units, observed) over the memory of peaks; with the
    # current interval's at the predicted load, what the marginal trade at the fleet cap
    # (trade.py) weighs one fewer worker against
    kv_demand: tuple[tuple[float, float], ...] = ()
    # prefill: (time, utilisation of the ready workers, wait-miss fraction) over the memory of peaks:
    # how steeply the misses follow the load (trade.py `miss_elasticity`), for the same trade
    miss_load: tuple[tuple[float, float, float], ...] = ()

    def observe(self, load: float, now: float, config: AutoscaleConfig) -> "PoolState":
        if self.ewma is None or self.last_t is None:
            first = now if self.first_t is None else self.first_t
            return replace(self, ewma=load, trend=0.0, last_t=now, first_t=first)
        dt = now - self.last_t
        if dt <= 0:
            return self
        ewma = config.ewma_alpha * load + (1 - config.ewma_alpha) * self.ewma
        trend = config.trend_alpha * (ewma - self.ewma) / dt + (1 - config.trend_alpha) * self.trend
        return replace(self, ewma=ewma, trend=trend, last_t=now)

    def predicted(self, observed: float, config: AutoscaleConfig) -> float:
        """The load ``predict_ahead_s`` from now: the last observation moved by the smoothed trend."""
        return max(0.0, observed + self.trend * config.predict_ahead_s)


@dataclass(frozen=True)
class ControllerState:
    """What the caller keeps between intervals (start with ``ControllerState()``)."""
    prefill: PoolState = PoolState()
    decode: PoolState = PoolState()
    idle_since: float | None = None   # no prompt arrived and none queued since then


@dataclass(frozen=True)
class _Want:
    """One pool's wish before cool-downs, step limits and bounds."""
    out: int                  # workers needed at the target utilisation (scale out if > current)
    out_reason: Reason
    fits_in: int              # workers the load fits at the scale-in utilisation
    may_shrink: bool          # the SLO holds with margin: shrinking is allowed at all
    predicted: float
    load_per_worker: float    # the load one worker takes at the target utilisation, unscaled
    kv_observed: float = 0.0  # decode: KV in worker units, in use (reservations included) + the waiting's
    kv_demand: float = 0.0    # decode: the same at the predicted load (at least the observed)


def _learn(st: PoolState, want: _Want, workers: int, dt: float, c: AutoscaleConfig) -> PoolState:
    """Adjust ``capacity_scale``: an SLO miss at a size the figure said was enough means one
    worker sustains less (scale so the figure asks for the grown size); the SLO holding with
    margin lets it recover toward 1 at ``capacity_recovery_per_s``."""
    if want.out_reason in (Reason.TTFT_SLO, Reason.ITL_SLO) and want.out > workers and want.predicted > 0:
        fit = want.predicted / (want.out * want.load_per_worker)
        return replace(st, capacity_scale=max(c.min_capacity_scale, min(st.capacity_scale, fit)))
    if want.may_shrink and st.capacity_scale < 1.0 and dt > 0:
        return replace(st, capacity_scale=min(1.0, st.capacity_scale * (1.0 + c.capacity_recovery_per_s * dt)))
    return st


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - 1e-9))


def _slo_step(workers: int, p90: float, target: float, c: AutoscaleConfig) -> int:
    """Workers after an SLO miss: grown by the relative miss, at least one, at most a step."""
    return workers + max(1, math.ceil(workers * min(c.max_step_up, p90 / target - 1.0)))


def _miss_step(workers: int, miss: float, budget: float, c: AutoscaleConfig) -> int | None:
    """Workers after more requests than ``budget`` missed the SLO: grown by ``ttft_miss_gain`` x the
    relative excess, at least one, at most a step; None when the misses are within budget."""
    if miss <= budget:
        return None
    return workers + max(1, math.ceil(workers * min(c.max_step_up, c.ttft_miss_gain * (miss / budget - 1.0))))


def _under_margin(p90: float | None, target: float, c: AutoscaleConfig) -> bool:
    return p90 is None or p90 <= c.slo_scale_in_margin * target


def _prefill_slo(s: PrefillSignals, c: AutoscaleConfig) -> tuple[bool, int | None, bool]:
    """Prefill's SLO view: (a backlog hurts, the size an SLO miss asks for or None, the SLO holds
    with margin). Measured, the wait-miss fraction decides (only misses more workers could have
    prevented count; grow by ``ttft_miss_gain`` x the relative excess over ``ttft_miss_budget``);
    else the TTFT p90 (over target while prompts queue: grow by the relative miss)."""
    miss = s.ttft_wait_miss_fraction
    if miss is not None:
        step = _miss_step(s.workers, miss, c.ttft_miss_budget, c)
        return step is not None, step, miss <= c.slo_scale_in_margin * c.ttft_miss_budget
    ttft = s.ttft_p90_ms
    hurting = ttft is None or ttft > c.slo_ttft_ms
    step = None
    if ttft is not None and hurting and s.queued_tokens > 0:
        step = _slo_step(s.workers, ttft, c.slo_ttft_ms, c)
    return hurting, step, _under_margin(ttft, c.slo_ttft_ms, c)


def _prefill_want(s: PrefillSignals, st: PoolState, c: AutoscaleConfig) -> _Want:
    pred = st.predicted(s.prompt_tokens_per_s, c)
    rate_out = max(s.prompt_tokens_per_s, pred)
    rate_in = max(s.prompt_tokens_per_s, st.ewma or 0.0, pred)
    # a backlog counts while it hurts (TTFT misses): a burst that TTFT absorbs is no reason to
    # grow, and with prefix-aware routing it sits on the nodes holding its prefix, which new
    # workers would not relieve
    hurting, slo_step, may_shrink = _prefill_slo(s, c)
    drain = s.queued_tokens / (c.queue_drain_fraction * c.slo_ttft_ms / 1000.0) if hurting else 0.0
    # arrivals need what a worker sustains within the SLO (learned scale); the backlog drains
    # at a worker's raw speed
    cap, raw = s.tokens_per_s_per_worker * st.capacity_scale, s.tokens_per_s_per_worker
    by_rate = _ceil(rate_out / (cap * c.target_utilization))
    out = _ceil(rate_out / (cap * c.target_utilization) + drain / (raw * c.target_utilization))
    reason = Reason.QUEUE if out > s.workers and by_rate <= s.workers else Reason.LOAD
    if slo_step is not None and slo_step > max(out, s.workers):
        out, reason = slo_step, Reason.TTFT_SLO
    fits_in = _ceil(rate_in / (cap * c.scale_in_utilization) + drain / (raw * c.scale_in_utilization))
    return _Want(out, reason, fits_in, may_shrink, rate_out, raw * c.target_utilization)


def _decode_want(s: DecodeSignals, st: PoolState, c: AutoscaleConfig, at_cap: bool = False) -> _Want:
    seqs_obs = s.running + s.waiting
    pred = st.predicted(seqs_obs, c)
    seqs_out = max(seqs_obs, pred)
    seqs_in = max(seqs_obs, st.ewma or 0.0, pred)
    spw = s.seqs_per_worker * st.capacity_scale
    # at the fleet cap a worker more for decode is one fewer for prefill: grow only for room about
    # to run out (decode_grow_usage_at_cap), not for the targets' headroom
    grow = c.decode_grow_usage_at_cap if at_cap and c.decode_grow_usage_at_cap is not None else None
    by_seqs = _ceil(seqs_out / (spw * (grow or c.target_utilization)))
    # workers' worth of KV in use, and what the waiting will take once admitted (at the context the
    # per-worker figure assumes): a backlog waiting for room is not in kv_usage yet
    kv_workers = s.kv_usage * s.ready_workers + s.waiting / s.seqs_per_worker
    kv_grow = grow or c.target_kv_usage
    by_kv = _ceil(kv_workers / kv_grow)
    if s.waiting > 0 and s.kv_usage >= kv_grow:
        by_kv = max(by_kv, s.workers + 1)            # requests wait and KV is full: at least one more
    out, reason = (by_kv, Reason.KV_ROOM) if by_kv > by_seqs else (by_seqs, Reason.LOAD)
    itl = s.itl_p90_ms
    if itl is not None and itl > c.slo_itl_ms and out <= s.workers:
        out, reason = _slo_step(s.workers, itl, c.slo_itl_ms, c), Reason.ITL_SLO
    fits_in = max(_ceil(seqs_in / (spw * c.scale_in_utilization)), _ceil(kv_workers / c.scale_in_kv_usage))
    may_shrink = _under_margin(s.itl_p90_ms, c.slo_itl_ms, c) and not waits_on_full(s, c)
    return _Want(out, reason, fits_in, may_shrink, seqs_out, s.seqs_per_worker * c.target_utilization,
                 kv_workers, kv_workers * max(1.0, seqs_out / seqs_obs) if seqs_obs > 0 else kv_workers)


def waits_on_full(s: DecodeSignals, c: AutoscaleConfig) -> bool:
    """Hand-offs wait for room and a ready worker is at or over the KV target (its own report,
    ``kv_usage_by_worker``): the waiting sit on full workers, whatever the mean says. A shrink
    (or giving way at the fleet cap) drains the least-loaded workers, the ones with room, and
    leaves the full ones as full: decode holds its size until the fullest have room or nothing
    waits. Without per-worker reports, False (the mean decides as before)."""
    return s.waiting > 0 and max(s.kv_usage_by_worker, default=0.0) >= c.target_kv_usage


def _pool(name: str, cur: int, want: _Want, st: PoolState, bounds: PoolBounds, c: AutoscaleConfig,
          now: float, hold: float) -> tuple[PoolDecision, PoolState]:
    def done(target: int, reason: Reason, state: PoolState) -> tuple[PoolDecision, PoolState]:
        if target > cur:
            state = replace(state, last_out_t=now, last_change_t=now)
        elif target < cur:
            state = replace(state, last_change_t=now)
        return PoolDecision(name, cur, target, reason, want.out, want.predicted), state

    memory = c.scale_in_memory_factor * c.scale_in_hold_s
    st = replace(st, peaks=tuple(x for x in st.peaks if x[0] > now - memory) + ((now, want.fits_in),))
    if cur < bounds.min_workers:
        return done(bounds.min_workers, Reason.AT_MIN, replace(st, below_since=None, needs=()))
    if cur > bounds.max_workers:
        return done(bounds.max_workers, Reason.AT_MAX, st)
    if want.out > cur:
        st = replace(st, below_since=None, needs=())
        if cur >= bounds.max_workers:
            return done(cur, Reason.AT_MAX, st)
        if now - st.last_out_t < c.cooldown_out_s:
            return done(cur, Reason.COOLDOWN, st)
        step = max(1, math.ceil(cur * c.max_step_up))
        return done(min(want.out, cur + step, bounds.max_workers), want.out_reason, st)
    if want.may_shrink and want.fits_in < cur:
        # the shrink goes no lower than the most the load needed over the last hold and the
        # longer memory, not the last (perhaps quietest) sample's need
        since = st.below_since if st.below_since is not None else now
        needs = tuple(x for x in st.needs if x[0] > now - hold) + ((now, want.fits_in),)
        st = replace(st, below_since=since, needs=needs)
        if cur <= bounds.min_workers:
            return done(cur, Reason.AT_MIN, st)
        # the floor below is the most the load needed over the memory: before the controller has
        # watched the pool for one hold it has seen too little to shrink on (a trade included)
        watched = now - (st.first_t if st.first_t is not None else now)
        if now - since < hold or watched < c.scale_in_hold_s:
            return done(cur, Reason.STEADY, st)
        if now - st.last_change_t < c.cooldown_in_s:
            return done(cur, Reason.COOLDOWN, st)
        step = max(1, math.floor(cur * c.max_step_down))
        floor = max(n for _, n in needs + st.peaks)
        if floor >= cur:
            return done(cur, Reason.STEADY, st)
        return done(max(floor, cur - step, bounds.min_workers), Reason.IDLE, st)
    return done(cur, Reason.STEADY, replace(st, below_since=None, needs=()))


def _to_min(d: PoolDecision, st: PoolState, bounds: PoolBounds, now: float) -> tuple[PoolDecision, PoolState]:
    """No prompt arrived and none waited for ``idle_hold_s``: neither pool gets new work, and
    more workers cannot speed up what is in flight (it does not move), so each pool drains to its
    minimum at once, not a step per cool-down (the drained workers finish what they hold first)."""
    if d.current <= bounds.min_workers:
        return replace(d, target=bounds.min_workers, reason=Reason.AT_MIN), st
    return (replace(d, target=bounds.min_workers, reason=Reason.IDLE),
            replace(st, last_change_t=now, below_since=None, needs=()))


def _at_cap(c: AutoscaleConfig, s: FleetSignals) -> bool:
    """Both pools and the draining workers hold the whole fleet cap."""
    return c.max_total_workers is not None and s.prefill.workers + s.decode.workers + s.draining >= c.max_total_workers


def _trade(c: AutoscaleConfig, s: FleetSignals, prefill: _Want) -> bool:
    """Prefill wants more workers and the fleet is at its cap (draining workers included): decode
    gives up what it does not need without waiting out its scale-in hold (still a step per
    cool-down, no lower than its peak need over the memory)."""
    return c.trade_at_cap and prefill.out > s.prefill.workers and _at_cap(c, s)


def _give_way(c: AutoscaleConfig, s: FleetSignals, wp: _Want, wd: _Want, d: PoolDecision, st: PoolState,
              now: float, elasticity: float | None = None) -> tuple[PoolDecision, PoolState]:
    """At the cap with prefill asking, and the wait-miss fraction measured: decode gives the workers
    whose move saves more requests on prefill than it puts at risk on decode (trade.py), a step per
    cool-down at most, never below its own ask, and not before one hold watched nor while its SLO
    or a full worker says it needs what it has."""
    miss = s.prefill.ttft_wait_miss_fraction
    watched = now - (st.first_t if st.first_t is not None else now)
    memory = c.scale_in_memory_factor * c.scale_in_hold_s
    if miss is None or d.target != d.current or not wd.may_shrink or watched < max(c.scale_in_hold_s, memory) \
            or now - st.last_change_t < c.cooldown_in_s:
        return d, st
    pw = s.prefill.workers
    rho = wp.predicted / (max(1, pw) * s.prefill.tokens_per_s_per_worker)
    demand = tuple(x for t, x in st.kv_demand if t < now) + (wd.kv_demand,)   # past: observed; now: predicted
    k = workers_to_trade(miss, c.ttft_miss_budget, rho, pw, demand, d.current,
                         max(c.decode.min_workers, wd.out), c.target_kv_usage,
                         max(1, math.floor(d.current * c.max_step_down)), elasticity)
    if k == 0:
        return d, st
    return replace(d, target=d.current - k, reason=Reason.TRADE), replace(st, last_change_t=now, below_since=None,
                                                                          needs=())


def _miss_load(kept: tuple[tuple[float, float, float], ...], s: PrefillSignals, since: float,
               now: float) -> tuple[tuple[float, float, float], ...]:
    """Prefill's (time, utilisation, wait-miss fraction) samples after ``since``, with this interval's
    when the fraction is measured and a worker is ready (the utilisation of those that served the window)."""
    kept = tuple(x for x in kept if x[0] > since)
    if s.ttft_wait_miss_fraction is None or s.ready_workers <= 0:
        return kept
    rho = s.prompt_tokens_per_s / (s.ready_workers * s.tokens_per_s_per_worker)
    return kept + ((now, rho, s.ttft_wait_miss_fraction),)


def _idle_since(s: PrefillSignals, since: float | None, now: float) -> float | None:
    """Since when no prompt arrived and none queued (None: prompts queue or arrive). With the
    caller's ``since_last_prompt_s``, from the last prompt's arrival; else from the first interval
    whose prompt rate (over the caller's window) was zero."""
    if s.queued_tokens > 0:
        return None
    if s.since_last_prompt_s is not None:
        return now - s.since_last_prompt_s
    if s.prompt_tokens_per_s > 0:
        return None
    return since if since is not None else now


def _fleet_cap(p: PoolDecision, d: PoolDecision, cap: int | None, decode_first: bool = False,
               prefill_min: int = 1, draining: int = 0) -> tuple[PoolDecision, PoolDecision]:
    """Trim growth so both pools together, and the ``draining`` workers still held, stay within
    ``cap``. Growth is shared in proportion
    to what each pool asked for (shrinking is never forced), or with ``decode_first`` decode's
    comes first and may displace prefill workers (down to ``prefill_min``): a decode pool
    without KV room is a cliff (sequences wait, preempt, every ITL stretches), a prefill pool
    short of workers only queues prompts longer."""
    if cap is None or p.target + d.target + draining <= cap:
        return p, d
    gp, gd = max(0, p.delta), max(0, d.delta)
    room = max(0, cap - draining - p.current - d.current - min(0, p.delta) - min(0, d.delta))
    if gp + gd == 0:
        return p, d
    if decode_first and gd > room:
        give = min(gd - room, max(0, min(p.current, p.target) - prefill_min))
        return (replace(p, target=min(p.current, p.target) - give, reason=Reason.AT_MAX),
                replace(d, target=d.current + room + give, reason=d.reason if room + give else Reason.AT_MAX))
    keep_d = min(gd, room) if decode_first else min(gd, room - min(gp, round(room * gp / (gp + gd))))
    keep_p = min(gp, room - keep_d)
    out = []
    for dec, grow, keep in ((p, gp, keep_p), (d, gd, keep_d)):
        if grow > keep:
            dec = replace(dec, target=dec.current + keep, reason=dec.reason if keep else Reason.AT_MAX)
        out.append(dec)
    return out[0], out[1]


def decide(config: AutoscaleConfig, signals: FleetSignals, state: ControllerState,
           now: float) -> tuple[FleetDecision, ControllerState]:
    """One interval: the target size of each pool, with its reason, and the new state."""
    dt_p = now - state.prefill.last_t if state.prefill.last_t is not None else 0.0
    dt_d = now - state.decode.last_t if state.decode.last_t is not None else 0.0
    ps = state.prefill.observe(signals.prefill.prompt_tokens_per_s, now, config)
    ds = state.decode.observe(float(signals.decode.running + signals.decode.waiting), now, config)
    wp, wd = _prefill_want(signals.prefill, ps, config), _decode_want(signals.decode, ds, config,
                                                                       _at_cap(config, signals))
    ps = _learn(ps, wp, signals.prefill.workers, dt_p, config)
    ds = _learn(ds, wd, signals.decode.workers, dt_d, config)
    memory = config.scale_in_memory_factor * config.scale_in_hold_s
    ds = replace(ds, kv_demand=tuple(x for x in ds.kv_demand if x[0] > now - memory) + ((now, wd.kv_observed),))
    ps = replace(ps, miss_load=_miss_load(ps.miss_load, signals.prefill, now - memory, now))
    # measured wait misses: decode gives way at the cap by marginal value (_give_way); else without its hold
    marginal = signals.prefill.ttft_wait_miss_fraction is not None
    trade = _trade(config, signals, wp)
    p, ps = _pool("prefill", signals.prefill.workers, wp, ps, config.prefill, config, now,
                  config.prefill_hold_factor * config.scale_in_hold_s)
    d, ds = _pool("decode", signals.decode.workers, wd, ds, config.decode, config, now,
                  0.0 if trade and not marginal else config.scale_in_hold_s)
    if trade and marginal:
        slope = miss_elasticity(tuple((r, m) for _, r, m in ps.miss_load))
        d, ds = _give_way(config, signals, wp, wd, d, ds, now, slope)
    idle_since = _idle_since(signals.prefill, state.idle_since, now)
    if config.idle_hold_s is not None and idle_since is not None and now - idle_since >= config.idle_hold_s:
        p, ps = _to_min(p, ps, config.prefill, now)
        if signals.decode.waiting == 0:   # hand-offs waiting for a slot start sooner on more workers
            d, ds = _to_min(d, ds, config.decode, now)
    p2, d2 = _fleet_cap(p, d, config.max_total_workers, config.decode_first_under_cap, config.prefill.min_workers,
                        signals.draining)
    # a trimmed scale-out that ended at no change must not start the scale-out cool-down
    if p2.target == p2.current and p.target > p.current:
        ps = replace(ps, last_out_t=state.prefill.last_out_t, last_change_t=state.prefill.last_change_t)
    if p2.target < min(p.target, p.current):      # displaced by decode at the fleet cap
        ps = replace(ps, last_out_t=state.prefill.last_out_t, last_change_t=now)
    if d2.target == d2.current and d.target > d.current:
        ds = replace(ds, last_out_t=state.decode.last_out_t, last_change_t=state.decode.last_change_t)
    return FleetDecision(p2, d2), ControllerState(ps, ds, idle_since)

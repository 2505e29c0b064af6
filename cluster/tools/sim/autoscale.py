"""The autoscaling controller (cluster/orchestration/autoscale, the real module)
on the simulator's virtual clock.

Every ``interval_s`` the `SimAutoscaler` builds `FleetSignals` from what the
live system reports too (per node: queued prefill tokens, running and waiting
sequences, KV use; over the last ``window_s``: uncached prompt tokens routed to
prefill, TTFT and per-request mean ITL), calls `decide`, and acts on the
decision through `ClusterSim`:

- grow: a new `SimNode` is provisioned now (worker-hours count from now) and
  joins the router ``startup_s`` later (ready), taking requests from then on;
- shrink: nodes still starting are cancelled first (newest first); then the
  ready nodes holding the fewest requests drain: the router stops routing to
  them at once, they finish (prefill: until every held KV block was pulled)
  what they hold, and leave when they hold nothing.

Per-worker capacity figures come from the cost model and the planner's
capacity equations (`sequences_that_fit`), unless given.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cluster.orchestration.autoscale import (AutoscaleConfig, ControllerState, DecodeSignals, FleetSignals,
                                             PrefillSignals, decide, wait_miss)
from cluster.tools.planner.capacity import sequences_that_fit
from cluster.tools.planner.pools import peak_rate, size_pools, split_at_cap
from cluster.tools.sim.cost_model import prefill_alone_s

if TYPE_CHECKING:
    from cluster.tools.sim.cluster_sim import ClusterSim
    from cluster.tools.sim.metrics import RequestRecord


@dataclass(frozen=True)
class SimAutoscale:
    """How the simulator runs the controller: its config, the interval, the
    signal window and a new worker's start-up delay (all simulated seconds)."""
    config: AutoscaleConfig
    interval_s: float = 5.0
    window_s: float = 30.0
    startup_s: float = 30.0
    prefill_tokens_per_s: float | None = None     # one prefill worker; None: from the cost model
    decode_seqs_per_worker: float | None = None   # one decode worker; None: KV room at the mean context
    # give the controller PrefillSignals.ttft_wait_miss_fraction (needs the cost model's pure_prefill
    # to tell a request's prefill alone); off: the TTFT p90 alone speaks for prefill's SLO
    ttft_wait_misses: bool = False

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.window_s <= 0 or self.startup_s < 0:
            raise ValueError("autoscale: interval_s and window_s must be > 0 and startup_s >= 0 simulated "
                             "seconds (--autoscale-interval, --startup-delay)")
        for name in ("prefill_tokens_per_s", "decode_seqs_per_worker"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"autoscale: {name} must be > 0 when given, got {v}")


def prefill_tokens_per_s(cost, chunk: int, mean_prompt: float) -> float:
    """Prompt tokens/s one node sustains: a full chunk at the mean prompt's
    middle (the mean context a chunk of a long prompt attends to)."""
    seconds = getattr(cost, "pure_prefill", None)
    if seconds is None:
        raise ValueError(f"cost model {getattr(cost, 'name', cost)!r} has no pure_prefill: give "
                         "SimAutoscale.prefill_tokens_per_s")
    chunk = max(1, int(min(chunk, mean_prompt)))
    return chunk / max(seconds(chunk, max(0.0, mean_prompt / 2 - chunk / 2)), 1e-9)


def decode_seqs_per_worker(kv_tokens: int, kv_bytes_per_token: int, mean_context: float,
                           max_num_seqs: int) -> float:
    """Sequences one decode node holds: the planner's KV equation (its KV bytes
    over a sequence's bytes at the mean context, prompt + output), capped by
    the batch size."""
    per_token = kv_bytes_per_token
    fit = sequences_that_fit(kv_tokens * per_token, max(1, int(mean_context)) * per_token)
    return float(max(1, min(fit, max_num_seqs)))


def planned_split(nodes: int, workload: list, cost, chunk: int, kv_tokens: int, max_num_seqs: int,
                  target_kv_usage: float = 0.75) -> tuple[int, int]:
    """Where an operator starts ``nodes`` workers under a fleet cap of ``nodes``: the planner's
    `size_pools` (cluster/tools/planner/pools.py) for the workload's request rate and mean
    prompt and output lengths at the cost model's speeds (prefill: `prefill_tokens_per_s`;
    decode: the sequences that fit one node's KV at the mean context, over one pure decode
    step of that batch), split by the planner's `split_at_cap`: decode holds the sequences in
    flight at the busiest window of one sequence's decode lifetime (mean output x step) at
    ``target_kv_usage``, prefill gets the rest."""
    if nodes < 2 or len(workload) < 2:
        raise ValueError("planned split: need at least 2 nodes and 2 requests (give the split instead)")
    span = max(workload[-1].arrival_s - workload[0].arrival_s, 1e-9)
    mean_in = float(np.mean([r.input_length for r in workload]))
    mean_out = float(np.mean([r.output_length for r in workload]))
    seqs = decode_seqs_per_worker(kv_tokens, cost.kv_bytes_per_token, mean_in + mean_out, max_num_seqs)
    step = cost.pure_decode(int(seqs), int(seqs * (mean_in + mean_out / 2)))
    rate = len(workload) / span
    plan = size_pools(rate, max(1, round(mean_in)), max(1, round(mean_out)),
                      prefill_tokens_per_s(cost, chunk, mean_in), seqs / max(step, 1e-9))
    lifetime = max(mean_out * step, 1e-3)
    peak = max(rate, peak_rate([r.arrival_s for r in workload], min(lifetime, span)))
    return split_at_cap(nodes, plan, peak, target_kv_usage)


class _Window:
    """(time, value) samples of the last ``span`` seconds."""
    __slots__ = ("span", "items")

    def __init__(self, span: float) -> None:
        self.span = span
        self.items: deque[tuple[float, float]] = deque()

    def add(self, t: float, v: float) -> None:
        self.items.append((t, v))

    def prune(self, now: float) -> None:
        while self.items and self.items[0][0] < now - self.span:
            self.items.popleft()

    def total(self) -> float:
        return sum(v for _, v in self.items)

    def mean(self) -> float | None:
        return self.total() / len(self.items) if self.items else None

    def p90(self) -> float | None:
        return float(np.percentile([v for _, v in self.items], 90)) if self.items else None


class SimAutoscaler:
    def __init__(self, sim: "ClusterSim", spec: SimAutoscale) -> None:
        self.sim, self.spec = sim, spec
        c = sim.config
        work = sim.workload
        mean_prompt = float(np.mean([r.input_length for r in work])) if work else 1.0
        mean_out = float(np.mean([r.output_length for r in work])) if work else 1.0
        self.prefill_tps = spec.prefill_tokens_per_s or prefill_tokens_per_s(
            sim.cost, c.max_num_batched_tokens, mean_prompt)
        self.seqs_per_worker = spec.decode_seqs_per_worker or decode_seqs_per_worker(
            sim.num_blocks * c.block_size, sim.cost.kv_bytes_per_token, mean_prompt + mean_out, c.max_num_seqs)
        self.state = ControllerState()
        self.prompt_tokens = _Window(spec.window_s)
        self.ttft_ms = _Window(spec.window_s)
        self.itl_ms = _Window(spec.window_s)
        # per request whose prefill alone fits the TTFT target: 1 if it missed by waiting
        self.wait_misses = _Window(spec.window_s)
        self.pure_prefill = getattr(sim.cost, "pure_prefill", None) if spec.ttft_wait_misses else None
        if spec.ttft_wait_misses and self.pure_prefill is None:
            raise ValueError(f"autoscale: ttft_wait_misses needs a cost model with pure_prefill, and "
                             f"{getattr(sim.cost, 'name', sim.cost)!r} has none: turn it off")
        self.reasons: Counter = Counter()
        self.changes: list[dict] = []
        # one row per interval: what the controller saw, what it decided, and what the fleet pays for
        self.intervals: list[dict] = []
        self.peak = {"prefill": 0, "decode": 0}
        self.last_prompt_s: float | None = None     # when the router last took a prompt

    # ---- what the cluster reports --------------------------------------------
    def on_routed(self, t: float, uncached_prefill_tokens: int) -> None:
        self.prompt_tokens.add(t, uncached_prefill_tokens)
        self.last_prompt_s = t

    def on_first_token(self, rec: "RequestRecord") -> None:
        assert rec.first_token_s is not None
        self.ttft_ms.add(rec.first_token_s, rec.ttft * 1000.0)
        if self.pure_prefill is not None:
            slo_s = self.spec.config.slo_ttft_ms / 1000.0
            alone = prefill_alone_s(self.pure_prefill, self.sim.config.max_num_batched_tokens,
                                    rec.prompt_tokens, rec.cached_tokens)
            miss = wait_miss(rec.ttft, alone, slo_s)   # the live head's definition too
            if miss is not None:
                self.wait_misses.add(rec.first_token_s, miss)

    def on_done(self, rec: "RequestRecord") -> None:
        itl = rec.mean_itl
        if itl is not None and rec.finish_s is not None:
            self.itl_ms.add(rec.finish_s, itl * 1000.0)

    # ---- every interval -------------------------------------------------------
    def start(self, t: float) -> None:
        self.sim.loop.at(t + self.spec.interval_s, self.tick)

    def signals(self) -> FleetSignals:
        sim, now = self.sim, self.sim.loop.now
        for w in (self.prompt_tokens, self.ttft_ms, self.itl_ms, self.wait_misses):
            w.prune(now)
        span = min(self.spec.window_s, max(now - sim.start_s, self.spec.interval_s))
        pre = [n for n in sim.ready_nodes("prefill")]
        dec = [n for n in sim.ready_nodes("decode")]
        p = PrefillSignals(
            workers=len(pre) + sim.starting_count("prefill"), ready_workers=len(pre),
            queued_tokens=sum(n.scheduler.num_waiting_tokens for n in pre),
            prompt_tokens_per_s=self.prompt_tokens.total() / span, ttft_p90_ms=self.ttft_ms.p90(),
            tokens_per_s_per_worker=self.prefill_tps,
            ttft_wait_miss_fraction=self.wait_misses.mean() if self.pure_prefill is not None else None,
            since_last_prompt_s=None if self.last_prompt_s is None else now - self.last_prompt_s)
        d = DecodeSignals(
            workers=len(dec) + sim.starting_count("decode"), ready_workers=len(dec),
            # as the live head (autoscaler.py: each worker's reported `running`): hand-offs waiting for
            # their KV (reserved while they prefill, or pulling) are not running; their blocks are in kv_usage
            running=sum(n.scheduler.num_running for n in dec),
            waiting=sum(n.scheduler.num_waiting + n.joining for n in dec),
            kv_usage=float(np.mean([n.scheduler.kv_usage for n in dec])) if dec else 0.0,
            itl_p90_ms=self.itl_ms.p90(), seqs_per_worker=self.seqs_per_worker,
            kv_usage_by_worker=tuple(n.scheduler.kv_usage for n in dec))
        return FleetSignals(p, d, draining=sim.draining_count("prefill") + sim.draining_count("decode"))

    def tick(self) -> None:
        sim, now = self.sim, self.sim.loop.now
        signals = self.signals()
        decision, self.state = decide(self.spec.config, signals, self.state, now)
        self.intervals.append(interval_row(now - sim.start_s, signals, decision, sim.draining_count))
        for pool in decision.pools:
            self.reasons[f"{pool.pool}:{pool.reason.value}"] += 1
            if pool.delta:
                self.changes.append({"t": round(now - sim.start_s, 3), "pool": pool.pool, "from": pool.current,
                                     "to": pool.target, "reason": pool.reason.value,
                                     "predicted_load": round(pool.predicted_load, 1)})
            if pool.delta > 0:
                for _ in range(pool.delta):
                    sim.provision(pool.pool, self.spec.startup_s)
            elif pool.delta < 0:
                sim.shrink(pool.pool, -pool.delta)
            self.peak[pool.pool] = max(self.peak[pool.pool], pool.target)
        if sim.has_work():
            self.sim.loop.after(self.spec.interval_s, self.tick)

    def summary(self) -> dict:
        c = self.spec.config
        return {"slo_ttft_ms": c.slo_ttft_ms, "slo_itl_ms": c.slo_itl_ms,
                "prefill_bounds": [c.prefill.min_workers, c.prefill.max_workers],
                "decode_bounds": [c.decode.min_workers, c.decode.max_workers],
                "max_total_workers": c.max_total_workers, "interval_s": self.spec.interval_s,
                "window_s": self.spec.window_s, "startup_s": self.spec.startup_s,
                "prefill_tokens_per_s_per_worker": round(self.prefill_tps, 1),
                "decode_seqs_per_worker": self.seqs_per_worker,
                "peak_workers": dict(self.peak), "decisions": dict(sorted(self.reasons.items())),
                "changes": self.changes, "intervals": self.intervals}


def interval_row(t: float, s: FleetSignals, d, draining) -> dict:
    """One interval's record: per pool the workers ready, starting and draining (all paid for),
    the load signals, and the controller's target and reason."""
    p, q = s.prefill, s.decode
    return {"t": round(t, 3),
            "prefill": {"ready": p.ready_workers, "starting": p.workers - p.ready_workers,
                        "draining": draining("prefill"), "tokens_per_s": round(p.prompt_tokens_per_s, 1),
                        "queued": p.queued_tokens, "ttft_p90_ms": p.ttft_p90_ms,
                        "wait_miss": p.ttft_wait_miss_fraction, "target": d.prefill.target,
                        "reason": d.prefill.reason.value},
            "decode": {"ready": q.ready_workers, "starting": q.workers - q.ready_workers,
                       "draining": draining("decode"), "running": q.running, "waiting": q.waiting,
                       "kv_usage": round(q.kv_usage, 3),
                       "kv_usage_max": round(max(q.kv_usage_by_worker, default=0.0), 3),
                       "kv_full": sum(u >= 0.9 for u in q.kv_usage_by_worker), "itl_p90_ms": q.itl_p90_ms,
                       "target": d.decode.target, "reason": d.decode.reason.value}}


def worker_hours(spans: list[tuple[str, float, float]], start: float, end: float) -> dict:
    """Worker-hours per role from (role, joined, left) spans, each cut to [start, end]."""
    out: dict[str, float] = {}
    for role, a, b in spans:
        out[role] = out.get(role, 0.0) + max(0.0, min(b, end) - max(a, start)) / 3600.0
    return {"total": sum(out.values()), **{k: out[k] for k in sorted(out)}}

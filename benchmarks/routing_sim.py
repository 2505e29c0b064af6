"""benchmarks/routing.py's workloads in the fleet simulator: a sweep of the miss weight.

The simulator (cluster/tools/sim) drives pdserve's own Router, schedulers and
prefix caches on a virtual clock with the CPU cost profile, so a routing rule
can be compared over many loads and samples in seconds where one real run of
routing.py takes minutes. Same shape as routing.py: --prefill-workers prefill
nodes + 1 decode node, block size 16, --kv-blocks per node, conditional
disaggregation off, at most 4 output tokens, in-flight prefix tracking on
(the Router's default, as in the cluster); prefix_aware with each --weights
value as CostWeights.uncached_token against round_robin, for each --loads factor (arrival times divided by it: 1 = the
real run's schedule on an idle CPU; the shared 2-core box runs 4 prefill
workers at a fraction of that speed) and each --seeds sample (the
shared-prefix shuffle and Poisson arrivals, or which Mooncake conversations).

    .venv/bin/python benchmarks/routing_sim.py [--weights 1,3,4,6,8 --loads 2,4,6 --seeds 0,1,2]

--busy-pool-miss sweeps CostWeights.busy_pool_miss (the miss weight's factor when
every prefill node has a queue) like --weights; --trace-block-len 64
--max-model-len 4096 --kv-blocks 2048 --max-num-batched-tokens 2048 is the replay of the
moon29-moon33 runs (each hash id 64 tokens, prompts capped at 4092). --queue-order
fewest_uncached (with --queue-max-pass-s) sets every node's waiting-queue order
(engine/queue_order.py) for both policies alike; --final-chunk-unpadded sets every node's
SchedulerConfig.final_chunk_unpadded (a step finishing a prefill takes no partial chunk);
--step-add-s adds a fixed cost to every simulated step (sensitivity to a per-step overhead).
--profile FILE uses a cost profile measured on this host (python -m cluster.tools.sim.measure) instead
of the committed cpu profile, e.g. to put the service floor in this host's seconds.
--split-prefill-min-tokens N spreads a prefill of N or more uncached tokens over
--split-prefill-nodes idle prefill nodes (cluster/tools/sim/split_prefill.py: the what-if of
Mooncake's chunked pipeline parallelism; --split-prefill-chunk-tokens, --split-link-gbps: its
pipeline chunk and link, 0 = the optimistic bound), for both policies alike.

--prefill-cores C pins the prefill nodes round-robin to C shared cores, as routing.py pins its workers
(4 workers on this 2-core host: 2); a step then runs at 1/k of its speed while k of its core's nodes are
mid-step. Without it each node has a core to itself, twice this host's capacity for 4 workers.

--min-hit-share F sets CostWeights.min_hit_share for prefix_aware (cluster/router/cost.py): a prefill
node's hit under F of the prompt counts as none (placed by queue and the tie rule instead).

--prefill-queue-limit N gives prefix_aware the prefill gate (ServeConfig.prefill_queue_limit:
arrivals held at the router while every prefill node has more than N prompt tokens outstanding;
round_robin routes on arrival either way).

Two references run beside the policies: service_floor (every sample: each request's prefill alone
on an idle node, computing only what an infinite cache in arrival order lacks; each TTFT quantile
of any routing over these nodes is at least the floor's) and, with --pooled-bound, pooled_bound
(the nodes pooled into one N times as fast whose cache holds everything).

Prints one JSON line: every run (simulated), per workload and weight the
mean and minimum prefix-aware hit rate over the ideal and the median TTFT p90
ratio round-robin / prefix-aware, and per load (``by_load``) each arm's medians over the
samples: hit rate over the ideal, TTFT p90, and round-robin's TTFT over the arm's at p50, p90
and the mean. Simulated figures, not measurements.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import replace

import numpy as np

from cluster.router import CostWeights, PolicyConfig
from cluster.tools.sim.cluster_sim import ClusterSim, SimConfig
from cluster.tools.sim.cost_model import ScaledCost, load_cost_model, prefill_alone_s
from cluster.tools.sim.split_prefill import SplitPrefill
from cluster.tools.sim.workload import PromptBuilder, TraceRequest
from routing_workloads import DEFAULT_TRACE, pick_conversations, read_rows

BLOCK = 16


def shared_prefix(groups: int, per_group: int, system_len: int, question_len: int, rate: float,
                  seed: int) -> list[TraceRequest]:
    """routing.py's shared-prefix workload as hash ids of 16 tokens: shuffled, Poisson arrivals."""
    sys_ids, q_ids = system_len // BLOCK, max(1, question_len // BLOCK)
    prompts, uid = [], 10 ** 9
    for g in range(groups):
        for _ in range(per_group):
            prompts.append(tuple(g * 10_000 + k for k in range(sys_ids)) + tuple(range(uid, uid + q_ids)))
            uid += q_ids
    rng, t, out = random.Random(seed), 0.0, []
    rng.shuffle(prompts)
    for n, ids in enumerate(prompts):
        t += rng.expovariate(rate)
        out.append(TraceRequest(f"r{n}", t, len(ids) * BLOCK, 4, ids))
    return out


def mooncake(n_conversations: int, time_scale: float, max_len: int, seed: int,
             block_len: int = BLOCK, min_turns: int = 1) -> list[TraceRequest]:
    """routing_workloads.mooncake_dataset's sample (the same conversations for a seed), as hash ids
    of ``block_len`` tokens each."""
    rows = read_rows(str(DEFAULT_TRACE))
    picked = pick_conversations(rows, n_conversations, seed, min_turns)
    t0, out = float(rows[picked[0]]["timestamp"]), []
    for i in picked:
        row = rows[i]
        length = min(max(1, round(int(row["input_length"]) * block_len / 512)), max_len)
        need = -(-length // block_len)
        ids = tuple(int(h) for h in row["hash_ids"])
        ids += tuple(-(i * 1000 + k + 2) for k in range(need - len(ids)))     # row-unique padding
        out.append(TraceRequest(f"r{i}", (float(row["timestamp"]) - t0) / 1000.0 * time_scale, length, 4,
                                ids[:need]))
    return out


def ideal_cached_tokens(reqs: list[TraceRequest], block_len: int = BLOCK) -> list[int]:
    """Each request's prompt tokens one infinite cache of BLOCK-token blocks would hold, requests in
    order (the last token of a prompt is always computed); each hash id is ``block_len`` tokens."""
    seen: set[tuple[int, ...]] = set()
    out = []
    per_id = block_len // BLOCK
    for r in reqs:
        cached, missed = 0, False
        for k in range((r.input_length - 1) // BLOCK):
            key = r.hash_ids[:k // per_id + 1] + ((k,) if per_id > 1 else ())
            missed = missed or key not in seen
            cached += 0 if missed else BLOCK
            seen.add(key)
        out.append(cached)
    return out


def ideal_hit_rate(reqs: list[TraceRequest], block_len: int = BLOCK) -> float:
    """The hit rate in tokens of ideal_cached_tokens."""
    return sum(ideal_cached_tokens(reqs, block_len)) / sum(r.input_length for r in reqs)


def split_config(args) -> SplitPrefill | None:
    """The --split-prefill-* options (None: off)."""
    n = getattr(args, "split_prefill_min_tokens", 0)
    return SplitPrefill(n, args.split_prefill_nodes, args.split_prefill_chunk_tokens,
                        args.split_link_gbps) if n else None


def add_split_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--split-prefill-min-tokens", type=int, default=0,
                   help="split a prefill of at least this many uncached tokens over idle prefill nodes "
                        "(simulated what-if, cluster/tools/sim/split_prefill.py; 0: off)")
    p.add_argument("--split-prefill-nodes", type=int, default=2, help="the group's size (the node and helpers)")
    p.add_argument("--split-prefill-chunk-tokens", type=int, default=0,
                   help="the pipeline's chunk (0: --max-num-batched-tokens)")
    p.add_argument("--split-link-gbps", type=float, default=0.0,
                   help="link between stages, Gbit/s (0: no transfer cost, the optimistic bound)")


def split_header(args) -> dict:
    """The options in the output JSON (nothing when off: the JSON is main's)."""
    if not args.split_prefill_min_tokens:
        return {}
    return {k: getattr(args, k) for k in ("split_prefill_min_tokens", "split_prefill_nodes",
                                          "split_prefill_chunk_tokens", "split_link_gbps")}


def simulate(reqs: list[TraceRequest], policy: str, weight: float, args, busy: float | None = None,
             pooled: int = 0) -> dict:
    """busy: CostWeights.busy_pool_miss (None: its default). pooled > 0: instead of
    --prefill-workers nodes, the pooled bound of ``pooled`` of them (see pooled_bound)."""
    w = CostWeights(uncached_token=weight, min_hit_share=getattr(args, "min_hit_share", 0.0))
    pc = PolicyConfig(0.0, 0, 1.0, weights=w if busy is None else replace(w, busy_pool_miss=busy))
    step_tokens = getattr(args, "max_num_batched_tokens", 512)
    nodes, blocks, seqs = args.prefill_workers, args.kv_blocks, 64
    if pooled:
        nodes, step_tokens, seqs = 1, step_tokens * pooled, seqs * pooled
        blocks = sum(-(-r.input_length // BLOCK) for r in reqs) + 64      # every prompt's blocks at once
    cfg = SimConfig(nodes, 1, policy=policy, policy_config=pc, block_size=BLOCK,
                    num_blocks=blocks, max_num_batched_tokens=step_tokens,
                    max_num_seqs=seqs, queue_order=getattr(args, "queue_order", "fcfs"),
                    queue_max_pass_s=getattr(args, "queue_max_pass_s", 20.0),
                    final_chunk_unpadded=getattr(args, "final_chunk_unpadded", False),
                    split_prefill=None if pooled else split_config(args),
                    prefill_queue_limit=-1 if pooled or policy != "prefix_aware"
                    else getattr(args, "prefill_queue_limit", -1),
                    prefill_cores=0 if pooled else getattr(args, "prefill_cores", 0))
    builder = PromptBuilder(BLOCK, getattr(args, "trace_block_len", BLOCK))
    cost = load_cost_model(getattr(args, "profile", "cpu"))
    add_s = getattr(args, "step_add_s", 0.0)
    if pooled or add_s:
        cost = ScaledCost(cost, 1.0 / (pooled or 1), add_s / (pooled or 1))
    s = ClusterSim(cfg, cost, reqs, builder).run()
    return {"hit_rate": round(s["hit_rate_tokens"], 4),
            **{f"ttft_{q}_s": round(s["ttft_s"][q], 3) for q in ("p50", "p90", "mean")}}


def service_floor(reqs: list[TraceRequest], args, block_len: int = BLOCK) -> dict:
    """A floor under every request's TTFT for any router over nodes of this speed: its prefill
    alone on an idle node (chunks of --max-num-batched-tokens, the cost profile), computing only
    what an infinite cache in arrival order would lack (ideal_cached_tokens). No wait, no sharing
    of steps, no eviction; so each quantile of it is under that of any real routing, and round-robin's
    TTFT over it bounds the ratio any router can reach (a request's prefill is not split over nodes)."""
    pure = load_cost_model(getattr(args, "profile", "cpu")).pure_prefill
    chunk = getattr(args, "max_num_batched_tokens", 512)
    add_s = getattr(args, "step_add_s", 0.0)
    floor = np.array([prefill_alone_s(pure, chunk, r.input_length, c)
                      + add_s * -(-(r.input_length - c) // chunk)
                      for r, c in zip(reqs, ideal_cached_tokens(reqs, block_len))])
    return {"hit_rate": round(ideal_hit_rate(reqs, block_len), 4),
            **{f"ttft_{q}_s": round(float(v), 3) for q, v in (("p50", np.percentile(floor, 50)),
                                                               ("p90", np.percentile(floor, 90)),
                                                               ("mean", floor.mean()))}}


def pooled_bound(reqs: list[TraceRequest], args) -> dict:
    """What no router over --prefill-workers nodes is expected to beat: the same nodes pooled into
    one, N times as fast (each step 1/N as long, N times the step's token budget and sequences),
    whose cache holds every block any request computed (no eviction: the ideal hit rate, as a free
    global KV pool would give), one queue (no request waits while a node idles). Simulated on the
    same cost profile and decode node; a reference for the TTFT ratios, not a policy."""
    return simulate(reqs, "prefix_aware", 1.0, args, pooled=args.prefill_workers)


def sweep(name: str, make, args, block_len: int = BLOCK) -> tuple[list[dict], dict, dict]:
    """Summary per (uncached_token, busy_pool_miss), keyed "w" (one busy value) or "w/busy", and per
    load: each arm's medians over the samples (ratios round-robin / arm; the pooled bound's too)."""
    grid = [(w, b) for w in args.weights for b in getattr(args, "busy_pool_miss", [CostWeights().busy_pool_miss])]
    runs: list[dict] = []
    by_weight: dict[tuple[float, float], list[tuple[float, float, float]]] = {k: [] for k in grid}
    by_load: dict[float, dict[str, list[dict]]] = {}
    for load in args.loads:
        for seed in args.seeds:
            reqs = [replace(r, arrival_s=r.arrival_s / load) for r in make(seed)]
            ideal, rr = ideal_hit_rate(reqs, block_len), simulate(reqs, "round_robin", 1.0, args)
            runs.append({"workload": name, "load": load, "seed": seed, "ideal_hit_rate": round(ideal, 4),
                         "policy": "round_robin", **rr})
            arms = by_load.setdefault(load, {})
            for w, b in grid:
                pa = simulate(reqs, "prefix_aware", w, args, b)
                runs.append({"workload": name, "load": load, "seed": seed, "policy": "prefix_aware",
                             "uncached_token": w, "busy_pool_miss": b, **pa})
                by_weight[w, b].append((pa["hit_rate"] / ideal, rr["ttft_p90_s"] / pa["ttft_p90_s"],
                                        pa["ttft_mean_s"]))
                arms.setdefault(f"prefix_aware {w}" if one_busy(grid) else f"prefix_aware {w}/{b}",
                                []).append(ratios(rr, pa, ideal))
            floor = service_floor(reqs, args, block_len)
            runs.append({"workload": name, "load": load, "seed": seed, "policy": "service_floor", **floor})
            arms.setdefault("service_floor", []).append(ratios(rr, floor, ideal))
            if getattr(args, "pooled_bound", False):
                bound = pooled_bound(reqs, args)
                runs.append({"workload": name, "load": load, "seed": seed, "policy": "pooled_bound", **bound})
                arms.setdefault("pooled_bound", []).append(ratios(rr, bound, ideal))
    one = one_busy(grid)
    summary = {(str(w) if one else f"{w}/{b}"): {
        "hit_over_ideal_mean": round(statistics.mean(h for h, _, _ in v), 3),
        "hit_over_ideal_min": round(min(h for h, _, _ in v), 3),
        "ttft_p90_ratio_median": round(statistics.median(r for _, r, _ in v), 2),
        "ttft_mean_s_mean": round(statistics.mean(m for _, _, m in v), 2)}
        for (w, b), v in by_weight.items()}
    per_load = {str(load): {arm: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
                            for arm, rs in arms.items()} for load, arms in by_load.items()}
    return runs, summary, per_load


def one_busy(grid: list[tuple[float, float]]) -> bool:
    return len({b for _, b in grid}) == 1


def ratios(rr: dict, arm: dict, ideal: float) -> dict[str, float]:
    """Round-robin's TTFT over ``arm``'s at p50, p90 and the mean, and ``arm``'s hit rate over the ideal."""
    return {"hit_over_ideal": arm["hit_rate"] / ideal, "ttft_p90_s": arm["ttft_p90_s"],
            **{f"ratio_{q}": rr[f"ttft_{q}_s"] / arm[f"ttft_{q}_s"] for q in ("p50", "p90", "mean")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    floats = lambda s: [float(x) for x in s.split(",")]   # noqa: E731
    p.add_argument("--weights", type=floats, default=[1.0, 3.0, 4.0, 6.0, 8.0])
    p.add_argument("--busy-pool-miss", type=floats, default=[CostWeights().busy_pool_miss],
                   help="CostWeights.busy_pool_miss values (1: a miss weighs the same on a busy pool)")
    p.add_argument("--loads", type=floats, default=[2.0, 4.0, 6.0])
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--workloads", default="shared-prefix,mooncake")
    p.add_argument("--prefill-workers", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=0, help="per node (0: 128 shared-prefix, 512 Mooncake)")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=12)
    p.add_argument("--rate", type=float, default=1.5)
    p.add_argument("--conversations", type=int, default=60)
    p.add_argument("--min-turns", type=int, default=1, help="draw only conversations of at least this many turns")
    p.add_argument("--trace-time-scale", type=float, default=0.0333)
    p.add_argument("--trace-block-len", type=int, default=BLOCK, help="Mooncake tokens per hash id (a multiple of 16)")
    p.add_argument("--max-model-len", type=int, default=1024, help="Mooncake prompts capped at this - 4 tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--queue-order", default="fcfs", help="every node's SchedulerConfig.queue_order (both policies)")
    p.add_argument("--queue-max-pass-s", type=float, default=20.0, help="SchedulerConfig.queue_max_pass_s")
    p.add_argument("--final-chunk-unpadded", action=argparse.BooleanOptionalAction, default=False,
                   help="every node's SchedulerConfig.final_chunk_unpadded (both policies)")
    p.add_argument("--step-add-s", type=float, default=0.0,
                   help="seconds added to every simulated step (a fixed per-step cost the CPU profile lacks)")
    p.add_argument("--prefill-queue-limit", type=int, default=-1,
                   help="prefix_aware only: ServeConfig.prefill_queue_limit (hold arrivals at the router while "
                        "every prefill node has more prompt tokens than this outstanding; -1: off)")
    p.add_argument("--profile", default="cpu",
                   help="cost profile: a name in cluster/tools/sim/profiles/ or a JSON file measured on this host "
                        "(python -m cluster.tools.sim.measure --output FILE); default cpu")
    p.add_argument("--min-hit-share", type=float, default=0.0,
                   help="CostWeights.min_hit_share for prefix_aware: a prefill node's hit under this share of the "
                        "prompt counts as none; 0: every hit counts")
    p.add_argument("--prefill-cores", type=int, default=0,
                   help="the prefill nodes share this many cores, pinned round-robin as routing.py pins its workers "
                        "(a step at 1/k speed while k of its core's nodes are mid-step); 0: a core each")
    p.add_argument("--pooled-bound", action="store_true",
                   help="also simulate the pooled bound for each load and sample (see pooled_bound)")
    add_split_args(p)
    args = p.parse_args()
    out: dict = {"benchmark": "routing_sim", "simulated": True, "profile": args.profile,
                 "prefill_workers": args.prefill_workers, "weights": args.weights,
                 "busy_pool_miss": args.busy_pool_miss, "loads": args.loads,
                 "seeds": args.seeds, "min_turns": args.min_turns, "queue_order": args.queue_order,
                 "queue_max_pass_s": args.queue_max_pass_s,
                 "final_chunk_unpadded": args.final_chunk_unpadded, "step_add_s": args.step_add_s,
                 "pooled_bound": args.pooled_bound, "prefill_queue_limit": args.prefill_queue_limit,
                 "prefill_cores": args.prefill_cores, "min_hit_share": args.min_hit_share,
                 **split_header(args), "runs": [], "summary": {}}
    kv = args.kv_blocks
    if args.trace_block_len % BLOCK:
        p.error(f"--trace-block-len must be a multiple of {BLOCK}")
    bl, cap = args.trace_block_len, args.max_model_len - 4
    for name, make, blocks, per_id in (
            ("shared-prefix", lambda seed: shared_prefix(args.groups, args.per_group, 384, 32, args.rate, seed),
             kv or 128, BLOCK),
            ("mooncake", lambda seed: mooncake(args.conversations, args.trace_time_scale, cap, seed, bl,
                                               args.min_turns),
             kv or 512, bl)):
        if name not in args.workloads.split(","):
            continue
        args.kv_blocks = blocks
        args.trace_block_len = per_id
        runs, summary, per_load = sweep(name, make, args, per_id)
        out["runs"] += runs
        out["summary"][name] = {"kv_blocks": blocks, "by_uncached_token": summary, "by_load": per_load}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

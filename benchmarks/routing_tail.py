"""What sets each routing policy's TTFT tail in the simulator (issue 26, sched35).

Runs benchmarks/routing_sim.py's block-64 Mooncake replay (or its shared-prefix
workload) for round-robin and prefix-aware, and records per request on its
prefill node: arrival, the queued prefill tokens ahead of it when it was added
(the node's `num_waiting_tokens`), when the scheduler first gave it tokens
(admission), its cached and uncached prompt tokens, its first token, and the
tokens the node computed for other requests while it waited. TTFT then splits
into the wait (arrival -> admission) and the compute (admission -> first
token, which includes sharing steps with others), and `alone` is what its
uncached tokens cost on an idle node (the cost model, one chunk per step).

For the requests above each run's TTFT p90 ("tail") and for all requests, it
prints the means of those parts, the share of cold turns (an infinite cache in arrival order
would hold under a quarter of the prompt: first turns), the tokens it missed against that
cache, the tokens computed for others in its own steps (shared), and
what the node computed during their wait: for whom (requests that arrived
before them), how many of those were cold. One JSON line; simulated, not
measured. --queue-order sets the prefill nodes' waiting-queue order
(SchedulerConfig.queue_order) for both arms alike; --split-prefill-min-tokens (routing_sim.py's
split options) spreads long cold prefills over idle prefill nodes, both arms alike.

    PYTHONPATH=$PWD:$PWD/benchmarks .venv/bin/python benchmarks/routing_tail.py --loads 1,1.2,1.4 --seeds 0,1,2
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field, replace

from cluster.router import CostWeights, PolicyConfig
from cluster.tools.sim.cluster_sim import ClusterSim, SimConfig
from cluster.tools.sim.cost_model import load_cost_model, prefill_alone_s
from cluster.tools.sim.workload import PromptBuilder
from routing_sim import BLOCK, add_split_args, ideal_cached_tokens, mooncake, shared_prefix, split_config


COLD = 0.25      # a cold turn: an infinite cache would hold under this share of its prompt


@dataclass
class _Req:
    node: str
    added_s: float
    queued_ahead: int                  # the node's queued prefill tokens when it was added
    waiting_ahead: int                 # requests queued there then
    admitted_s: float | None = None
    cached: int = 0
    uncached: int = 0
    others: dict[str, int] = field(default_factory=dict)   # tokens computed for others while it waited
    shared: int = 0                    # tokens computed for others in its own steps (admission -> first token)


class Recorder:
    """Wraps each prefill node's scheduler: add_request and schedule."""

    def __init__(self, sim: ClusterSim) -> None:
        self.sim, self.reqs, self.waiting = sim, {}, {}
        for nid, node in sim.nodes.items():
            if node.role == "prefill":
                self._wrap(nid, node.scheduler)

    def _wrap(self, nid: str, sched) -> None:
        add, schedule, waiting = sched.add_request, sched.schedule, self.waiting.setdefault(nid, set())
        computing: set[str] = set()

        def add_request(request) -> None:
            self.reqs[request.request_id] = _Req(nid, self.sim.loop.now, sched.num_waiting_tokens,
                                                 sched.num_waiting)
            waiting.add(request.request_id)
            add(request)

        def scheduled():
            out = schedule()
            now = self.sim.loop.now
            for seq in out.seqs:
                r = self.reqs.get(seq.request.request_id)
                if r is not None and r.admitted_s is None:
                    r.admitted_s, r.cached = now, seq.request.num_cached_tokens or 0
                    r.uncached = seq.request.num_prompt_tokens - r.cached
                    waiting.discard(seq.request.request_id)
                    computing.add(seq.request.request_id)
            total = sum(seq.num_new_tokens for seq in out.seqs)
            for seq in out.seqs:
                rid = seq.request.request_id
                if rid in computing:
                    self.reqs[rid].shared += total - seq.num_new_tokens
                    if seq.sample:
                        computing.discard(rid)
            for rid in waiting:
                others = self.reqs[rid].others
                for seq in out.seqs:
                    others[seq.request.request_id] = others.get(seq.request.request_id, 0) + seq.num_new_tokens
            return out

        sched.add_request, sched.schedule = add_request, scheduled


def run_one(reqs, policy: str, args, cost, reusable: dict[str, int]) -> tuple[dict, list[dict]]:
    pc = PolicyConfig(0.0, 0, 1.0, weights=CostWeights(uncached_token=args.weight))
    cfg = SimConfig(args.prefill_workers, 1, policy=policy, policy_config=pc, block_size=BLOCK,
                    num_blocks=args.kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=64,
                    queue_order=args.queue_order, queue_max_pass_s=args.queue_max_pass_s,
                    final_chunk_unpadded=args.final_chunk_unpadded, split_prefill=split_config(args))
    sim = ClusterSim(cfg, cost, reqs, PromptBuilder(BLOCK, args.trace_block_len))
    rec = Recorder(sim)
    s = sim.run()
    by_id = {r.request_id: r for r in sim.records}
    rows = []
    for rid, r in rec.reqs.items():
        o = by_id[rid]
        if o.first_token_s is None or r.admitted_s is None:
            continue
        ahead = {k: v for k, v in r.others.items() if k != rid}
        cold_ahead = sum(1 for k in ahead if reusable.get(k, 0) < COLD * by_id[k].prompt_tokens)
        rows.append({"ttft": o.first_token_s - o.arrival_s, "wait": r.admitted_s - o.arrival_s,
                     "compute": o.first_token_s - r.admitted_s, "prompt": o.prompt_tokens, "cached": r.cached,
                     "uncached": r.uncached, "cold": reusable[rid] < COLD * o.prompt_tokens,
                     "missed": reusable[rid] - r.cached, "shared": r.shared,
                     "alone": prefill_alone_s(cost.pure_prefill, args.max_num_batched_tokens, r.cached + r.uncached,
                                              r.cached),
                     "queued_ahead": r.queued_ahead, "waiting_ahead": r.waiting_ahead,
                     "tokens_ahead": sum(ahead.values()), "reqs_ahead": len(ahead), "cold_ahead": cold_ahead,
                     "later_ahead": sum(1 for k in ahead if k in by_id and by_id[k].arrival_s > o.arrival_s),
                     "split": sim.split is not None and rid in sim.split.split_ids})
    summ = {"hit_rate": round(s["hit_rate_tokens"], 4),
            **{f"ttft_{q}_s": round(s["ttft_s"][q], 3) for q in ("p50", "p90", "mean")},
            **({"split_prefill": s["split_prefill"]} if "split_prefill" in s else {})}
    if "split_prefill" in summ:      # admitted with enough uncached tokens to split (split or not: no idle helper)
        summ["split_prefill"]["eligible"] = sum(r["uncached"] >= args.split_prefill_min_tokens for r in rows)
    return summ, rows


def describe(rows: list[dict]) -> dict:
    if not rows:
        return {"n": 0}
    m = lambda k: round(statistics.mean(float(r[k]) for r in rows), 2)   # noqa: E731
    return {"n": len(rows), "cold_share": m("cold"), "split_share": m("split"), **{k: m(k) for k in (
        "ttft", "wait", "compute", "alone", "prompt", "uncached", "missed", "shared", "queued_ahead", "waiting_ahead", "tokens_ahead",
        "reqs_ahead", "cold_ahead", "later_ahead")},
        "wait_share": round(sum(r["wait"] for r in rows) / max(1e-9, sum(r["ttft"] for r in rows)), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    floats = lambda s: [float(x) for x in s.split(",")]   # noqa: E731
    p.add_argument("--loads", type=floats, default=[1.0, 1.2, 1.4])
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--workload", choices=("mooncake", "shared-prefix"), default="mooncake")
    p.add_argument("--weight", type=float, default=6.0, help="CostWeights.uncached_token")
    p.add_argument("--queue-order", default="fcfs", help="SchedulerConfig.queue_order of every node")
    p.add_argument("--queue-max-pass-s", type=float, default=20.0, help="SchedulerConfig.queue_max_pass_s")
    p.add_argument("--final-chunk-unpadded", action=argparse.BooleanOptionalAction, default=False,
                   help="SchedulerConfig.final_chunk_unpadded of every node")
    p.add_argument("--prefill-workers", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=2048)
    p.add_argument("--conversations", type=int, default=120)
    p.add_argument("--trace-time-scale", type=float, default=0.071)
    p.add_argument("--trace-block-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--rate", type=float, default=1.5)
    add_split_args(p)
    args = p.parse_args()
    cost, out = load_cost_model("cpu"), {"benchmark": "routing_tail", "simulated": True, "args": vars(args),
                                          "runs": [], "pooled": {}}
    if args.workload == "shared-prefix":
        args.trace_block_len, args.kv_blocks = BLOCK, 128
        make = lambda seed: shared_prefix(8, 12, 384, 32, args.rate, seed)   # noqa: E731
    else:
        make = lambda seed: mooncake(args.conversations, args.trace_time_scale, args.max_model_len - 4,   # noqa: E731
                                     seed, args.trace_block_len)
    pooled: dict[str, dict[str, list]] = {}
    for load in args.loads:
        for seed in args.seeds:
            reqs = [replace(r, arrival_s=r.arrival_s / load) for r in make(seed)]
            ideal_tokens = ideal_cached_tokens(reqs, args.trace_block_len)
            ideal = sum(ideal_tokens) / sum(r.input_length for r in reqs)
            reusable = {r.request_id: c for r, c in zip(reqs, ideal_tokens)}
            for policy in ("round_robin", "prefix_aware"):
                summ, rows = run_one(reqs, policy, args, cost, reusable)
                ttfts = sorted(r["ttft"] for r in rows)
                p90 = ttfts[int(0.9 * len(rows))]
                summ.update(ttft_p99_s=round(ttfts[int(0.99 * len(rows))], 3), ttft_max_s=round(ttfts[-1], 3),
                            wait_max_s=round(max(r["wait"] for r in rows), 3))
                tail = [r for r in rows if r["ttft"] >= p90]
                out["runs"].append({"load": load, "seed": seed, "policy": policy,
                                    "hit_over_ideal": round(summ["hit_rate"] / ideal, 3), **summ,
                                    "tail": describe(tail), "all": describe(rows)})
                pool = pooled.setdefault(policy, {"tail": [], "all": []})
                pool["tail"] += tail
                pool["all"] += rows
    out["pooled"] = {pol: {k: describe(v) for k, v in d.items()} for pol, d in pooled.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

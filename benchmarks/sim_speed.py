"""Simulator speed on a loaded trace, and what the cyclic garbage collector costs it.

Runs the same overlaid Mooncake conversation workload through `ClusterSim`
as `ClusterSim.run` does it (long-lived nodes frozen, rarer young
collections) and with the collector left at Python's defaults (the run's
`gc.freeze` / `gc.set_threshold` calls made no-ops), timing every collection
with `gc.callbacks`. Each run is a fresh process, alternating, ``--repeats``
times each: in one process the second run is 2-5 s faster whatever it is
(the first one grows the heap). Also times building the prompts (tokens,
packed bytes, chained hashes) alone. Prints one JSON line; every run's
results must be identical (checked by a digest of the summary).

    .venv/bin/python benchmarks/sim_speed.py [--limit 500 --time-scale 4 --copies 20 \\
        --prefill-nodes 500 --decode-nodes 500 --repeats 2]
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import subprocess
import sys
import time
import types
from pathlib import Path

from cluster.router import PolicyConfig
from cluster.tools.sim import cluster_sim
from cluster.tools.sim.cluster_sim import ClusterSim, SimConfig
from cluster.tools.sim.cost_model import load_cost_model
from cluster.tools.sim.workload import PromptBuilder, compress_time, load_mooncake, overlay

ROOT = Path(__file__).resolve().parents[1]

TRACE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


class CollectorClock:
    """Seconds spent in collections, per generation (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds, self.count, self._t0 = [0.0, 0.0, 0.0], [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._t0
            self.count[info["generation"]] += 1


def run_once(args, cost, reqs, tune_gc: bool) -> tuple[dict, CollectorClock]:
    config = SimConfig(args.prefill_nodes, args.decode_nodes, policy="prefix_aware", policy_config=PolicyConfig(),
                       block_size=args.block_size,
                       max_num_batched_tokens=cost.meta.get("scheduler", {}).get("max_num_batched_tokens", 8192),
                       max_num_seqs=cost.meta.get("scheduler", {}).get("max_num_seqs", 256))
    sim = ClusterSim(config, cost, reqs, PromptBuilder(args.block_size))
    gc.collect()
    clock = CollectorClock()
    saved = cluster_sim.gc
    if not tune_gc:       # the run's freeze / threshold calls do nothing: Python's defaults stay
        cluster_sim.gc = types.SimpleNamespace(freeze=lambda: None, unfreeze=lambda: None,
                                               get_threshold=gc.get_threshold, set_threshold=lambda *a: None)
    gc.callbacks.append(clock)
    try:
        summary = sim.run()
    finally:
        gc.callbacks.remove(clock)
        cluster_sim.gc = saved
    return summary, clock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--limit", type=int, default=500)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--copies", type=int, default=20)
    ap.add_argument("--prefill-nodes", type=int, default=500)
    ap.add_argument("--decode-nodes", type=int, default=500)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    ap.add_argument("--mode", choices=("gc_tuned", "gc_default"), help=argparse.SUPPRESS)   # one child run
    args = ap.parse_args()
    cost = load_cost_model(args.profile)
    reqs = overlay(compress_time(load_mooncake(args.trace, args.limit), args.time_scale), args.copies)

    if args.mode:
        builder = PromptBuilder(args.block_size)
        t0 = time.perf_counter()
        for r in reqs:
            builder.prompt(r)
        prompt_s = time.perf_counter() - t0
        summary, clock = run_once(args, cost, reqs, args.mode == "gc_tuned")
        digest = hashlib.sha256(json.dumps(dict(summary, sim=None), sort_keys=True).encode()).hexdigest()
        print(json.dumps({"wall_s": summary["sim"]["wall_s"], "gc_s": sum(clock.seconds),
                          "gc_s_by_generation": clock.seconds, "collections": clock.count,
                          "prompt_build_s": prompt_s, "digest": digest}))
        return
    runs: dict[str, list[dict]] = {"gc_default": [], "gc_tuned": []}
    for _ in range(args.repeats):
        for mode in runs:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
            runs[mode].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    r2 = lambda xs: [round(x, 2) for x in xs]   # noqa: E731
    out = {"bench": "sim_speed", "requests": len(reqs), "prefill_nodes": args.prefill_nodes,
           "decode_nodes": args.decode_nodes,
           "prompt_build_us_per_request": r2([r["prompt_build_s"] / len(reqs) * 1e6 for rs in runs.values() for r in rs])}
    for mode, rs in runs.items():
        out[mode] = {"wall_s": r2([r["wall_s"] for r in rs]),
                     "ms_per_request": [round(r["wall_s"] / len(reqs) * 1e3, 3) for r in rs],
                     "gc_s": [round(r["gc_s"], 3) for r in rs], "collections": [r["collections"] for r in rs]}
    out["identical_results"] = len({r["digest"] for rs in runs.values() for r in rs}) == 1
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Prefix-aware vs round-robin routing over 2 prefill workers, side by side.

A shared-prefix workload (--groups system prompts x --per-group questions,
shuffled, Poisson arrivals) runs against the same cluster shape twice: 2
prefill workers + 1 decode worker, router_policy prefix_aware and then
round_robin. Conditional disaggregation is off for both
(local_prefill_threshold=0, local_prefill_hit_ratio=1.0), so every prompt is
prefilled by a prefill worker and the policies differ only in which one.

Reported per policy: the prefill pool's prefix-cache hit rate (hit / queried
prompt tokens on the prefill workers, from their counters) beside the ideal
hit rate of the workload (one infinite cache, requests in order: every
group's system prompt missed once), the hit rate clients see in `usage`
(which also counts the decode worker's own cache), TTFT p50/p90/p99 and
throughput. Each prefill worker is pinned to its own core (all its threads,
os.sched_setaffinity from this process); the decode worker, frontend and load
generator float.

The default KV cache per worker (128 blocks of 16 tokens) holds about half of
the groups' system prompts (24 blocks each) plus the requests in flight: the
fleet's cache holds the workload only if groups are partitioned between the
prefill workers, which prefix-aware routing does and round-robin does not.
With --kv-blocks 1024 the caches hold everything and the policies differ by
one extra miss per group (round-robin computes each prefix on both workers).

    .venv/bin/python benchmarks/routing.py [--groups 6 --per-group 12 --rate 1.5 --kv-blocks 128]

Prints one JSON line. Figures vary with the machine's load; compare the two
policies of one run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from cluster.tools.bench import arrivals, datasets as ds  # noqa: E402
from cluster.tools.bench.report import summarize  # noqa: E402
from cluster.tools.bench.runner import RunnerConfig, run_load  # noqa: E402
from cluster.config import ServeConfig  # noqa: E402
from cluster.server_stack import start_stack  # noqa: E402
from disagg_vs_colocated import free_port, machine  # noqa: E402


def prefill_counters(stack) -> tuple[float, float]:
    """(hit, queried) prompt tokens summed over the prefill workers (counters)."""
    reg, hit, queried = stack.metrics.registry, 0.0, 0.0
    for wid, ref in stack.backend.workers.items():
        if ref.pool == "prefill":
            lbl = {"worker": wid, "pool": "prefill"}
            hit += reg.get_sample_value("pdserve_prefix_cache_hit_tokens_total", lbl) or 0.0
            queried += reg.get_sample_value("pdserve_prefix_cache_queried_tokens_total", lbl) or 0.0
    return hit, queried


async def settled_counters(stack, wait_s: float = 1.0) -> tuple[float, float]:
    """Counters once the workers' reports (every 0.1 s) have caught up."""
    await asyncio.sleep(wait_s)
    return prefill_counters(stack)


async def pin_prefill_workers(stack) -> dict[str, int]:
    cores, pinned = sorted(os.sched_getaffinity(0)), {}
    prefill = sorted(w for w, ref in stack.backend.workers.items() if ref.pool == "prefill")
    for i, wid in enumerate(prefill):
        pid = (await stack.backend.workers[wid].actor.ready.remote())["pid"]
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {cores[i % len(cores)]})
            except (ProcessLookupError, PermissionError):
                pass
        pinned[wid] = cores[i % len(cores)]
    return pinned


async def run_policy(policy: str, base: dict, spec: ds.SharedPrefixSpec, args) -> dict:
    t0 = time.monotonic()
    stack = await start_stack(ServeConfig(**base, router_policy=policy))
    try:
        pinned = await pin_prefill_workers(stack)
        info = stack.backend.model_info()
        reqs = ds.shared_prefix_dataset(spec, info.vocab_size, args.seed)     # the same for every policy
        offsets = arrivals.schedule(arrivals.ArrivalSpec(args.rate), len(reqs), args.seed)
        warm = ds.random_dataset(ds.RandomSpec(64, 2), 4, info.vocab_size, 12345)
        await run_load(stack.grpc.target, warm, [0.0] * len(warm), RunnerConfig(progress=False))
        startup = time.monotonic() - t0
        hit0, q0 = await settled_counters(stack)
        run = await run_load(stack.grpc.target, reqs, offsets, RunnerConfig(progress=False, drain_timeout_s=120))
        hit1, q1 = await settled_counters(stack)
    finally:
        await stack.drain_and_stop(1.0)
    s = summarize(run)
    hit, queried = hit1 - hit0, q1 - q0
    return {"pinned_cores": pinned, "startup_s": round(startup, 1),
            "ideal_hit_rate": ds.ideal_prefix_hit_rate(reqs, info.block_size), "requests": len(reqs),
            "prefill_hit_rate": hit / queried if queried else None,
            "client_reported_hit_rate": s["prefix_cache_hit_rate"],
            "ttft_ms": {k: s["ttft_ms"][k] for k in ("p50", "p90", "p99", "mean")},
            "e2e_ms_p50": s["e2e_ms"]["p50"],
            "request_throughput": s["request_throughput"], "total_token_throughput": s["total_token_throughput"],
            "finished": s["requests"]["finished"], "failures": s["failures"]}


async def main_async(args) -> dict:
    import ray

    spec = ds.SharedPrefixSpec(args.groups, args.per_group, args.system_len, args.question_len, args.output_len)
    base = dict(model=args.model, grpc_port=free_port(), metrics_port=0, http_port=0, torch_threads=1,
                cpus_per_worker=1.0,
                prefill_workers=2, decode_workers=1, num_kv_blocks=args.kv_blocks, max_model_len=args.max_model_len,
                local_prefill_threshold=0, local_prefill_hit_ratio=1.0, log_level="WARNING",
                ray_temp_dir=tempfile.mkdtemp(prefix="pdserve-bench-ray-"))
    out: dict = {}
    try:
        for policy in ("prefix_aware", "round_robin"):
            out[policy] = await run_policy(policy, base, spec, args)
    finally:
        ray.shutdown()
    ideal = out["prefix_aware"].pop("ideal_hit_rate")
    out["round_robin"].pop("ideal_hit_rate")
    n = out["prefix_aware"].pop("requests")
    out["round_robin"].pop("requests")
    for r in out.values():
        r["prefill_hit_rate_over_ideal"] = round(r["prefill_hit_rate"] / ideal, 3) if r["prefill_hit_rate"] else None
    pa, rr = out["prefix_aware"], out["round_robin"]
    return {"benchmark": "routing", "model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, fp32)",
            "machine": machine(),
            "workload": {"groups": args.groups, "per_group": args.per_group, "system_len": args.system_len,
                         "question_len": args.question_len, "output_len": args.output_len,
                         "rate_per_s": args.rate, "requests": n, "prefill_workers": 2, "decode_workers": 1},
            "ideal_hit_rate": ideal, **out,
            "ttft_p90_round_robin_over_prefix_aware": round(rr["ttft_ms"]["p90"] / pa["ttft_ms"]["p90"], 3)
            if pa["ttft_ms"]["p90"] and rr["ttft_ms"]["p90"] else None,
            "targets": "prefix_aware hit rate >= 0.9 x ideal; TTFT p90 >= 2x better than round_robin"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF dir or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--per-group", type=int, default=12)
    p.add_argument("--system-len", type=int, default=384)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-blocks", type=int, default=128, help="KV blocks per worker (default 128: fewer "
                   "than all groups' system prompts need, so where a group goes decides what stays cached)")
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args()
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()

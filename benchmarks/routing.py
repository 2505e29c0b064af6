"""Prefix-aware vs round-robin routing over --prefill-workers (2) prefill workers, side by side.

A workload runs against the same cluster shape twice: --prefill-workers
prefill workers + 1 decode worker, router_policy prefix_aware and then
round_robin. --workload shared-prefix (default): --groups system prompts x
--per-group questions, shuffled, Poisson arrivals at --rate. --workload
mooncake: a replay of the Mooncake conversation trace, --conversations whole
conversations sampled from it (--min-turns N: only among those of at least N
turns), lengths scaled by --trace-block-len / 512 and times by --trace-time-scale
(benchmarks/routing_workloads.py). Conditional disaggregation is off for both
(local_prefill_threshold=0, local_prefill_hit_ratio=1.0), so every prompt is
prefilled by a prefill worker and the policies differ only in which one.
--min-hit-share F sets ServeConfig.router_min_hit_share (prefix_aware: a prefill node's cached
prefix under F of the prompt counts as no hit; cluster/router/cost.py). --min-hit-share-arm F adds
an arm prefix_aware_min_hit (prefix_aware with router_min_hit_share F) right after prefix_aware,
so one run compares the two settings.

--prefill-queue-limit N gives prefix_aware the prefill gate (ServeConfig.prefill_queue_limit:
arrivals held at the frontend while every prefill node has more than N prompt tokens
outstanding, each routed when a prefill ends and leaves room; round_robin routes on arrival either way).
--gated-arm-limit N adds a third arm, prefix_aware_gated (prefix_aware with the gate at N), run
between the two, so the gate is compared with and without in one run.
--floor-arm adds a first arm, service_floor: the same requests, prefix_aware, sent one at a time
(each when the one before has finished), so every TTFT is that request's service alone on an idle
pool with the cache prefix-aware routing builds: no wait, no shared steps. A router that does not
split a prefill over nodes cannot bring a request's TTFT under it by much (only by more hits than
prefix_aware gets), so round_robin's TTFT over this floor (``ttft_round_robin_over_service_floor``)
bounds the ratio routing can reach on the sample at this rate, and prefix_aware's over it
(``ttft_prefix_aware_over_service_floor``) is what queueing and shared steps cost it.
The router counts prefixes it has sent before their KV events arrive
(--no-track-in-flight: only reported ones); the JSON records that and the
cost weights. benchmarks/routing_sim.py runs the same workloads in the
simulator, over many loads and samples in seconds.

Reported per policy: the prefill pool's prefix-cache hit rate (hit / queried
prompt tokens on the prefill workers, from their counters) beside the ideal
hit rate of the workload (one infinite cache, requests in order: every
group's system prompt missed once), the hit rate clients see in `usage`
(which also counts the decode worker's own cache), TTFT p50/p90/p99 and
throughput, and whether the pool kept up with the arrivals (``backlog``: finished
over offered req/s, the drain after the last send, TTFT by thirds of the run), and
where the CPU went over the load (``cpu_s``: CPU seconds per worker process and its
busiest thread, the driver process with the frontend, router and load generator,
and Ray's other processes; benchmarks/process_cpu.py; ``cpu_s_idle``: the same over
3 s of the same cluster idle just before, the part that is paid per second, not per
request). Each prefill worker is pinned to its own core (all its threads,
os.sched_setaffinity from this process); the decode worker, frontend and load
generator float.

The default KV cache per worker (128 blocks of 16 tokens) holds about half of
the groups' system prompts (24 blocks each) plus the requests in flight: the
fleet's cache holds the workload only if groups are partitioned between the
prefill workers, which prefix-aware routing does and round-robin does not.
With --kv-blocks 1024 the caches hold everything and the policies differ by
one extra miss per group (round-robin computes each prefix on both workers).

    .venv/bin/python benchmarks/routing.py [--groups 6 --per-group 12 --rate 1.5 --kv-blocks 128]
    .venv/bin/python benchmarks/routing.py --workload mooncake --prefill-workers 4 [--conversations 60]

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
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from cluster.tools.bench import arrivals, datasets as ds  # noqa: E402
from cluster.tools.bench.report import summarize  # noqa: E402
from cluster.tools.bench.runner import RunnerConfig, run_load  # noqa: E402
from cluster.config import ServeConfig  # noqa: E402
from cluster.router import CostWeights  # noqa: E402
from cluster.server_stack import start_stack  # noqa: E402
from disagg_vs_colocated import free_port, machine  # noqa: E402
from process_cpu import cpu_split, snapshot  # noqa: E402
from routing_workloads import DEFAULT_TRACE, MooncakeSample, mooncake_dataset  # noqa: E402


def prefill_counters(stack) -> tuple[float, float, dict[str, float]]:
    """(hit, queried) prompt tokens summed over the prefill workers (counters), and
    the tokens each worker computed (queried - hit: how the policy spread the work)."""
    reg, hit, queried, computed = stack.metrics.registry, 0.0, 0.0, {}
    for wid, ref in stack.backend.workers.items():
        if ref.pool == "prefill":
            lbl = {"worker": wid, "pool": "prefill"}
            h = reg.get_sample_value("pdserve_prefix_cache_hit_tokens_total", lbl) or 0.0
            q = reg.get_sample_value("pdserve_prefix_cache_queried_tokens_total", lbl) or 0.0
            hit, queried, computed[wid] = hit + h, queried + q, q - h
    return hit, queried, computed


async def settled_counters(stack, wait_s: float = 1.0) -> tuple[float, float, dict[str, float]]:
    """Counters once the workers' reports (every 0.1 s) have caught up."""
    await asyncio.sleep(wait_s)
    return prefill_counters(stack)


async def pin_prefill_workers(stack) -> dict[str, int]:
    cores, pinned = sorted(os.sched_getaffinity(0)), {}
    prefill = sorted(w for w, ref in stack.backend.workers.items() if ref.pool == "prefill")
    for i, wid in enumerate(prefill):
        pid = (await stack.backend.workers[wid].actor.ready.remote()).pid
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {cores[i % len(cores)]})
            except (ProcessLookupError, PermissionError):
                pass
        pinned[wid] = cores[i % len(cores)]
    return pinned


def workload(args, vocab_size: int) -> tuple[list[ds.BenchRequest], list[float]]:
    """The requests and their send offsets (the same for every policy)."""
    if args.workload == "mooncake":
        reqs = mooncake_dataset(MooncakeSample(args.trace_path, args.conversations, args.trace_block_len,
                                               args.trace_time_scale, args.max_model_len - args.output_len,
                                               args.output_len, args.seed, args.min_turns), vocab_size)
        return reqs, [r.arrival_s or 0.0 for r in reqs]
    spec = ds.SharedPrefixSpec(args.groups, args.per_group, args.system_len, args.question_len, args.output_len)
    reqs = ds.shared_prefix_dataset(spec, vocab_size, args.seed)
    return reqs, arrivals.schedule(arrivals.ArrivalSpec(args.rate), len(reqs), args.seed)


@dataclass(frozen=True)
class Arm:
    policy: str                   # ServeConfig.router_policy
    gate: int                     # ServeConfig.prefill_queue_limit (-1: routed on arrival)
    one_at_a_time: bool = False   # each request sent when the one before has finished (the service floor)
    min_hit_share: float | None = None   # ServeConfig.router_min_hit_share (None: --min-hit-share's)


def arms(args) -> dict[str, Arm]:
    """The arms in the order they run: (with --floor-arm) the service floor, prefix_aware one
    request at a time; prefix_aware with --prefill-queue-limit; (with --min-hit-share-arm F >= 0)
    prefix_aware with router_min_hit_share F; (with --gated-arm-limit L >= 0) prefix_aware with the
    gate at L; round_robin, routed on arrival."""
    out = {"service_floor": Arm("prefix_aware", -1, one_at_a_time=True)} if args.floor_arm else {}
    out["prefix_aware"] = Arm("prefix_aware", args.prefill_queue_limit)
    if args.min_hit_share_arm >= 0:
        out["prefix_aware_min_hit"] = Arm("prefix_aware", args.prefill_queue_limit,
                                          min_hit_share=args.min_hit_share_arm)
    if args.gated_arm_limit >= 0:
        out["prefix_aware_gated"] = Arm("prefix_aware", args.gated_arm_limit)
    out["round_robin"] = Arm("round_robin", -1)
    return out


def send_plan(offsets: list[float], arm: Arm) -> tuple[list[float], int]:
    """The send offsets and concurrency cap the arm's run uses: the workload's own, or
    (one_at_a_time) every request due at once behind a cap of one, so each is sent, in order,
    when the one before has finished."""
    return ([0.0] * len(offsets), 1) if arm.one_at_a_time else (list(offsets), 0)


async def run_policy(arm: Arm, base: dict, args) -> dict:
    t0 = time.monotonic()
    cfg = dict(base, router_policy=arm.policy, prefill_queue_limit=arm.gate)
    if arm.min_hit_share is not None:
        cfg["router_min_hit_share"] = arm.min_hit_share
    stack = await start_stack(ServeConfig(**cfg))
    try:
        pinned = await pin_prefill_workers(stack)
        info = stack.backend.model_info()
        reqs, offsets = workload(args, info.vocab_size)
        warm = ds.random_dataset(ds.RandomSpec(64, 2), 4, info.vocab_size, 12345)
        await run_load(stack.grpc.target, warm, [0.0] * len(warm), RunnerConfig(progress=False))
        startup = time.monotonic() - t0
        pids = {w: (await ref.actor.ready.remote()).pid for w, ref in stack.backend.workers.items()}
        idle0 = snapshot(pids)
        hit0, q0, c0 = await settled_counters(stack, wait_s=3.0)
        cpu0 = snapshot(pids)
        sends, cap = send_plan(offsets, arm)
        run = await run_load(stack.grpc.target, reqs, sends,
                             RunnerConfig(progress=False, drain_timeout_s=240, max_concurrency=cap))
        cpu1 = snapshot(pids)
        hit1, q1, c1 = await settled_counters(stack)
        waits = prefill_waits(stack)          # the warm-up's 4 distinct prompts never wait
        recovery = recoveries(stack)
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
            "finished": s["requests"]["finished"], "failures": s["failures"], "prefill_prefix_waits": waits,
            "recovery": recovery,
            "offered_rate_per_s": round(len(reqs) / max(sends), 3) if max(sends) > 0 else None,
            **backlog(run, s["elapsed_s"]),
            "computed_tokens_per_worker": {w: round(c1[w] - c0.get(w, 0.0)) for w in sorted(c1)},
            "cpu_s": cpu_split(cpu0, cpu1), "cpu_s_idle": cpu_split(idle0, cpu0)}


def backlog(run, elapsed_s: float) -> dict:
    """Whether the pool kept up with the arrivals: the time from the last send to the
    last response (a queue that grew over the run drains here, long after the last
    request's own latency) and the mean TTFT of each third of the requests by send
    time (rising thirds: the queue grows; a pool below saturation keeps them level
    apart from the trace's bursts)."""
    done = sorted((r for r in run.results if r.ok and r.ttft_s is not None), key=lambda r: r.sent_s)
    k = len(done) // 3
    thirds = [done[:k], done[k:2 * k], done[2 * k:]] if k else [done]
    last_send = max((r.sent_s for r in run.results), default=0.0)
    return {"drain_after_last_send_s": round(elapsed_s - last_send, 1),
            "ttft_mean_ms_by_third": [round(1000 * sum(r.ttft_s for r in t) / len(t)) for t in thirds if t]}


def recoveries(stack) -> dict[str, int]:
    """What kept requests going besides the plain path (nonzero only; the warm-up has none):
    the frontend's recovery counters (cluster/orchestration/journal.py: a decode node that
    found no KV room in time and recomputed the prompt itself, a failed pull, a full queue)
    and the workers' expiries (a prefill lease no decode node read in time, a decode
    reservation no submit claimed). Under overload these say whether a policy's figures
    include work done twice."""
    out = {k: v for k, v in asdict(stack.backend.journal.counters).items() if v}
    reg = stack.metrics.registry
    for name, key in (("pdserve_lease_expiries_total", "lease_expiries"),
                      ("pdserve_decode_reservation_expiries_total", "reservation_expiries")):
        n = sum(reg.get_sample_value(name, {"worker": wid, "pool": ref.pool}) or 0.0
                for wid, ref in stack.backend.workers.items())
        if n:
            out[key] = int(n)
    return out


def prefill_waits(stack) -> dict[str, float]:
    """Requests that waited for an in-flight prefix on the prefill workers (counters), and the blocks saved."""
    reg, out = stack.metrics.registry, {"requests": 0.0, "blocks_saved": 0.0}
    for wid, ref in stack.backend.workers.items():
        if ref.pool == "prefill":
            lbl = {"worker": wid, "pool": "prefill"}
            out["requests"] += reg.get_sample_value("pdserve_prefix_waits_total", lbl) or 0.0
            out["blocks_saved"] += reg.get_sample_value("pdserve_prefix_wait_blocks_saved_total", lbl) or 0.0
    return out


async def main_async(args) -> dict:
    import ray

    base = dict(model=args.model, grpc_port=free_port(), metrics_port=0, http_port=0, torch_threads=1,
                cpus_per_worker=1.0, prefill_workers=args.prefill_workers, decode_workers=1,
                num_kv_blocks=args.kv_blocks, max_model_len=args.max_model_len,
                local_prefill_threshold=0, local_prefill_hit_ratio=1.0, log_level="WARNING",
                router_track_in_flight=args.track_in_flight, queue_order=args.queue_order,
                queue_max_pass_s=args.queue_max_pass_s, final_chunk_unpadded=args.final_chunk_unpadded,
                router_min_hit_share=args.min_hit_share,
                ray_temp_dir=tempfile.mkdtemp(prefix="pdserve-bench-ray-"))
    out: dict = {}
    try:
        for name, arm in arms(args).items():
            out[name] = await run_policy(arm, base, args)
    finally:
        ray.shutdown()
    ideal = out["prefix_aware"]["ideal_hit_rate"]
    n = out["prefix_aware"]["requests"]
    offered_by_arm = {}
    for name, r in out.items():
        r.pop("ideal_hit_rate")
        r.pop("requests")
        r["prefill_hit_rate_over_ideal"] = round(r["prefill_hit_rate"] / ideal, 3) if r["prefill_hit_rate"] else None
        offered = offered_by_arm[name] = r.pop("offered_rate_per_s")
        r["finished_over_offered"] = round(r["request_throughput"] / offered, 3) if offered else None
    ratios = {f"ttft_round_robin_over_{arm}": ttft_ratio(out["round_robin"], r)
              for arm, r in out.items() if arm != "round_robin"}
    if "service_floor" in out:
        ratios["ttft_prefix_aware_over_service_floor"] = ttft_ratio(out["prefix_aware"], out["service_floor"])
    out["offered_rate_per_s"] = offered_by_arm["prefix_aware"]
    return {"benchmark": "routing", "model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, fp32)",
            "machine": machine(), "workload": workload_info(args, n),
            "ideal_hit_rate": ideal, **out, **ratios,
            "targets": "prefix_aware hit rate >= 0.95 x ideal; TTFT >= 3x better than round_robin"}


def ttft_ratio(num: dict, den: dict) -> dict[str, float | None]:
    """``num``'s TTFT p50 / p90 / mean over ``den``'s (None where either is missing)."""
    a, b = num["ttft_ms"], den["ttft_ms"]
    return {k: round(a[k] / b[k], 3) if a[k] and b[k] else None for k in ("p50", "p90", "mean")}


def workload_info(args, n: int) -> dict:
    shape = {"requests": n, "prefill_workers": args.prefill_workers, "decode_workers": 1,
             "router_track_in_flight": args.track_in_flight, "cost_weights": asdict(CostWeights()),
             "queue_order": args.queue_order, "queue_max_pass_s": args.queue_max_pass_s,
             "final_chunk_unpadded": args.final_chunk_unpadded,
             "prefix_aware_prefill_queue_limit": args.prefill_queue_limit,
             "router_min_hit_share": args.min_hit_share, "service_floor_arm": args.floor_arm,
             "prefix_aware_min_hit_router_min_hit_share": args.min_hit_share_arm if args.min_hit_share_arm >= 0 else None,
             "prefix_aware_gated_prefill_queue_limit": args.gated_arm_limit if args.gated_arm_limit >= 0 else None,
             "kv_blocks_per_worker": args.kv_blocks, "output_len": args.output_len}
    if args.workload == "mooncake":
        return {"name": "mooncake", "trace": Path(args.trace_path).name, "conversations": args.conversations,
                "min_turns": args.min_turns,
                "trace_block_len": args.trace_block_len, "trace_time_scale": args.trace_time_scale,
                "max_prompt_len": args.max_model_len - args.output_len, **shape}
    return {"name": "shared-prefix", "groups": args.groups, "per_group": args.per_group,
            "system_len": args.system_len, "question_len": args.question_len, "rate_per_s": args.rate, **shape}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF dir or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--workload", choices=("shared-prefix", "mooncake"), default="shared-prefix")
    p.add_argument("--prefill-workers", type=int, default=2)
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--per-group", type=int, default=12)
    p.add_argument("--system-len", type=int, default=384)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=4, help="output tokens (a cap for mooncake)")
    p.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson; shared-prefix)")
    p.add_argument("--trace-path", default=str(DEFAULT_TRACE), help="Mooncake conversation trace (JSONL)")
    p.add_argument("--conversations", type=int, default=60, help="whole conversations sampled from the trace")
    p.add_argument("--min-turns", type=int, default=1,
                   help="sample only among conversations of at least this many turns (1: all of them)")
    p.add_argument("--trace-block-len", type=int, default=16, help="tokens per trace hash id (512 in the trace)")
    p.add_argument("--trace-time-scale", type=float, default=1 / 40, help="replay seconds per trace second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-blocks", type=int, default=128, help="KV blocks per worker (default 128: fewer "
                   "than all groups' system prompts need, so where a group goes decides what stays cached)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--track-in-flight", action=argparse.BooleanOptionalAction, default=True,
                   help="the router counts prefixes it sent before their KV events arrive (the default)")
    p.add_argument("--queue-order", default="fcfs", help="every worker's waiting-queue order (ServeConfig."
                   "queue_order): fcfs or fewest_uncached, the same for both policies")
    p.add_argument("--queue-max-pass-s", type=float, default=20.0, help="ServeConfig.queue_max_pass_s")
    p.add_argument("--final-chunk-unpadded", action=argparse.BooleanOptionalAction, default=False,
                   help="ServeConfig.final_chunk_unpadded on every worker, the same for both policies")
    p.add_argument("--min-hit-share", type=float, default=0.0,
                   help="ServeConfig.router_min_hit_share (prefix_aware: a node's hit under this share of the "
                        "prompt counts as none; round_robin ignores it)")
    p.add_argument("--min-hit-share-arm", type=float, default=-1.0,
                   help="also run prefix_aware with ServeConfig.router_min_hit_share at this share (arm "
                        "prefix_aware_min_hit, after prefix_aware), so one run compares both; -1: no such arm")
    p.add_argument("--prefill-queue-limit", type=int, default=-1,
                   help="prefix_aware's ServeConfig.prefill_queue_limit (the prefill gate: arrivals held at the "
                        "frontend while every prefill node has more prompt tokens outstanding; -1: routed on arrival); "
                        "round_robin routes on arrival either way")
    p.add_argument("--floor-arm", action="store_true",
                   help="first run the service floor: prefix_aware with each request sent when the one before has "
                        "finished (arm service_floor; round_robin over it bounds the ratio routing can reach)")
    p.add_argument("--gated-arm-limit", type=int, default=-1,
                   help="also run prefix_aware with the prefill gate at this limit (arm prefix_aware_gated, between "
                        "prefix_aware and round_robin), so one run compares both; -1: no third arm")
    args = p.parse_args()
    if args.prefill_workers < 1:
        p.error("--prefill-workers must be >= 1")
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()

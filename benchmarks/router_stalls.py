"""What route()'s slowest decisions have in common (issue 26: its mean was 2-3x its p50).

router_overhead.py's world and decisions (64 workers, ~1M indexed blocks, the
same prompts and load reports), each ``route()`` call bracketed by
``getrusage(RUSAGE_THREAD)`` (minor / major faults, user / system time,
context switches) and counted against ``gc.callbacks`` events. Prints one JSON
line: wall p50 / p99 / p99.9 / max / mean, the collections seen, and the
slowest decisions with what each did (the in-flight table's doublings show as
faults and system time where the new array is first touched in the call), when
on the router's clock, and how many sends were open (routed, prefill not ended:
none ends here unless ``--prefill-s`` says when, as in router_overhead.py, so
every decision so far is open; each is refreshed half an in-flight ttl after it
was sent or last refreshed, which shows once ``--interval-s`` takes the run
past 5 s).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/router_stalls.py [--decisions 20000] [--slowest 10] [--interval-s 0.002]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import time
from collections import deque

from cluster.router import PolicyConfig, Router, RouterConfig, RoutingRequest, WorkerLoad
from engine.block_hash import block_hashes

import router_overhead as ro          # this folder's: the script's own folder is on the path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=20000)
    ap.add_argument("--slowest", type=int, default=10)
    ap.add_argument("--interval-s", type=float, default=0.0002,
                    help="router clock time between two decisions (router_overhead.py's; 0.002: 40 s, four ttls)")
    ap.add_argument("--prefill-s", type=float, default=None,
                    help="end each send this long (router clock) after it was routed, as a cluster's prefill "
                         "does (Router.on_prefill_end); default: none ends")
    args = ap.parse_args()
    world_args = ro.default_world()
    rng, clock = random.Random(0), ro.VirtualClock()
    router = Router(RouterConfig(policy_config=PolicyConfig()), rng=random.Random(1), clock=clock)
    for i in range(64):
        router.add_worker(f"w{i:03d}", "prefill" if i < 32 else "decode")
    world = ro.build(world_args, router, rng)
    world.pop("log")
    gc.freeze()
    collections: list[int] = []
    gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)

    def report_load(wid: str) -> None:
        router.update_load(wid, WorkerLoad(queued_prefill_tokens=rng.randint(0, 8000), running=rng.randint(0, 64),
                                           waiting=rng.randint(0, 8), kv_usage=rng.random()))

    for i in range(64):
        report_load(f"w{i:03d}")
    rows, ends = [], deque()                         # ends: (router time, request id), in time order
    for i in range(args.decisions):
        while ends and ends[0][0] <= clock.now:
            router.on_prefill_end(ends.popleft()[1])
        prompt = ro.make_prompt(world_args, world, rng, i)
        req = RoutingRequest(f"r{i}", len(prompt), tuple(block_hashes(prompt, 16, None)), 16)
        r0, g0 = resource.getrusage(resource.RUSAGE_THREAD), len(collections)
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        router.route(req)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        if args.prefill_s is not None:
            ends.append((clock.now + args.prefill_s, req.request_id))
        rows.append({"decision": i, "t_s": round(clock.now, 4), "open_sends": router.open_sends, "wall_us": round((t1 - t0) / 1e3, 1), "cpu_us": round((c1 - c0) / 1e3, 1),
                     "minflt": r1.ru_minflt - r0.ru_minflt, "majflt": r1.ru_majflt - r0.ru_majflt,
                     "user_us": round((r1.ru_utime - r0.ru_utime) * 1e6), "sys_us": round((r1.ru_stime - r0.ru_stime) * 1e6),
                     "switches": r1.ru_nvcsw - r0.ru_nvcsw + r1.ru_nivcsw - r0.ru_nivcsw,
                     "collections": len(collections) - g0})
        clock.now += args.interval_s
        if i % 4 == 0:
            report_load(f"w{rng.randrange(64):03d}")
    wall = [r["wall_us"] for r in rows]
    slow = sorted(rows, key=lambda r: -r["wall_us"])
    print(json.dumps({"bench": "router_stalls", "decisions": args.decisions, "interval_s": args.interval_s,
                      "prefill_s": args.prefill_s, "open_sends_max": max(r["open_sends"] for r in rows),
                      "route_p50_us": ro.pct(wall, 0.5), "route_p99_us": ro.pct(wall, 0.99),
                      "route_p999_us": ro.pct(wall, 0.999), "route_max_us": max(wall),
                      "route_mean_us": round(sum(wall) / len(wall), 1),
                      "over_1ms": sum(1 for w in wall if w >= 1000),
                      "faults_in_calls_over_1ms": sum(r["minflt"] + r["majflt"] for r in slow if r["wall_us"] >= 1000),
                      "collections_by_generation": {g: collections.count(g) for g in sorted(set(collections))},
                      "slowest": slow[:args.slowest], "loadavg_1m": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()

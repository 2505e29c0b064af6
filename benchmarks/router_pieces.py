"""Where a routing decision's time goes when the C decider makes it (cluster/router/native_router.py).

The world of router_overhead.py (64 workers, ~1M indexed blocks, the same
events and prompts), then per prompt one piece timed, in turn, each on a prompt
nothing has touched yet in this decision (so each sees the caches a real
decision sees): the index walk alone (``BlockTable.walk``, plus building its
small result list), the in-flight match alone (``InFlightTable.match``), the
C decision alone (``Decider.decide``: both of those again, the costs, the
argmins, the optimistic loads, the in-flight record of 125 blocks, the
records), and ``Router.route`` (the decision plus its Python edge). Every
prompt is routed once, by ``route()`` or by ``decide()`` directly, so the state
moves on as in router_overhead.py. Prints one JSON line: p50 / p99 thread CPU
and wall microseconds per piece.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/router_pieces.py [--decisions 20000] [--track-in-flight 0]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time

from cluster.router import PolicyConfig, Router, RouterConfig, RoutingRequest, WorkerLoad
from engine.block_hash import block_hashes

import router_overhead as ro          # this folder's: the script's own folder is on the path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=20000)
    ap.add_argument("--track-in-flight", type=int, choices=(0, 1), default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blocks", type=int, default=1_000_000, help="(worker, block) entries to index")
    args = ap.parse_args()
    world_args = ro.default_world(args.blocks)
    rng, clock = random.Random(args.seed), ro.VirtualClock()
    router = Router(RouterConfig(policy_config=PolicyConfig(), track_in_flight=bool(args.track_in_flight)),
                    rng=random.Random(args.seed + 1), clock=clock)
    for i in range(64):
        router.add_worker(f"w{i:03d}", "prefill" if i < 32 else "decode")
    world = ro.build(world_args, router, rng)
    world.pop("log")
    gc.freeze()
    fast = router._fast
    assert fast is not None, "no C decider: nothing to profile (PDSERVE_ROUTER_NATIVE=0 or no compiler)"
    core, table, flight = fast._core, router.index.native_table, router.in_flight
    assert table is not None
    pieces: dict[str, list[tuple[float, float]]] = {"walk": [], "in_flight_match": [], "decide": [], "route": []}
    for i in range(args.decisions):
        prompt = ro.make_prompt(world_args, world, rng, i)
        hashes = tuple(block_hashes(prompt, world_args.block_size, None))
        req = RoutingRequest(f"r{i}", len(prompt), hashes, world_args.block_size)
        names = ("walk", "in_flight_match", "decide", "route") if args.track_in_flight else ("walk", "decide", "route")
        name = names[i % len(names)]
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        if name == "walk":
            table.walk(hashes)
        elif name == "in_flight_match":
            flight.table.match(hashes, clock.now, flight.epochs)  # type: ignore[union-attr]
        elif name == "decide":
            core.decide(hashes, req.prompt_tokens, req.block_size, req.request_id, 0, clock.now)
        else:
            router.route(req)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        pieces[name].append(((c1 - c0) / 1e3, (t1 - t0) / 1e3))
        if name in ("walk", "in_flight_match"):
            router.route(req)
        clock.now += world_args.interval_s
        if i % 4 == 0:
            router.update_load(f"w{rng.randrange(64):03d}", WorkerLoad(
                queued_prefill_tokens=rng.randint(0, 8000), running=rng.randint(0, 64),
                waiting=rng.randint(0, 8), kv_usage=rng.random()))
    out = {"bench": "router_pieces", "decisions": args.decisions, "track_in_flight": bool(args.track_in_flight),
           "loadavg_1m": round(os.getloadavg()[0], 2)}
    for name, xs in pieces.items():
        if not xs:
            continue
        for k, label in ((0, "cpu"), (1, "wall")):
            vals = [x[k] for x in xs]
            out[f"{name}_{label}_p50_us"] = round(ro.pct(vals, 0.5), 2)
            out[f"{name}_{label}_p99_us"] = round(ro.pct(vals, 0.99), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

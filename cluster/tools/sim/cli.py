"""`pdserve simulate`: run the fleet simulator on a trace, optionally over a
sweep, and write JSON (and PNG plots).

    pdserve simulate --trace ../shared/traces/mooncake/conversation_trace.jsonl \\
        --prefill-nodes 4 --decode-nodes 12 --router-policy prefix_aware \\
        --sweep policy=prefix_aware,least_loaded,round_robin --sweep pd=1:3,1:1 \\
        --output out.json --plot-dir plots/ --jobs 2

`--autoscale` sizes the pools while it runs with the autoscaling controller
(cluster/orchestration/autoscale, the module the live head runs), on the virtual
clock; --prefill-nodes / --decode-nodes are then the starting sizes:

    pdserve simulate --trace ... --prefill-nodes 4 --decode-nodes 4 --autoscale \
        --slo-ttft-ms 2000 --slo-itl-ms 100 --min-prefill-workers 2 --max-prefill-workers 60 \
        --min-decode-workers 2 --max-decode-workers 60 --max-total-workers 100

A sweep's runs are independent: `--jobs N` runs N of them at once, each in its
own process (one core each); the output is the same as with `--jobs 1`, apart
from the wall-time figures.
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from cluster.router import POLICIES, PolicyConfig

SWEEP_KEYS = {"policy": str, "pd": str, "copies": int, "time_scale": float, "num_blocks": int,
              "prefill_nodes": int, "decode_nodes": int, "local_prefill_threshold": int}


WALL_FIELDS = {"wall_s", "sim_s_per_wall_s"}


def without_wall(doc):
    """A simulate output (or any part of it) without its wall-time fields: what
    must not change between runs of the same inputs (e.g. ``--jobs 1`` vs ``N``)."""
    if isinstance(doc, dict):
        return {k: without_wall(v) for k, v in doc.items() if k not in WALL_FIELDS}
    if isinstance(doc, list):
        return [without_wall(v) for v in doc]
    return doc


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="discrete-event fleet simulator (real router and schedulers)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--trace", help="Mooncake JSONL trace (timestamp, input/output length, hash_ids)")
    w.add_argument("--synthetic", metavar="N", type=int, help="instead of a trace: N shared-prefix requests")
    w.add_argument("--synthetic-rate", type=float, default=5.0, help="requests/s of --synthetic")
    w.add_argument("--limit", type=int, help="first N trace requests only")
    w.add_argument("--time-scale", type=float, default=1.0, help="compress arrival times by this factor")
    w.add_argument("--copies", type=int, default=1, help="overlay this many copies, each with its own salt")
    w.add_argument("--rate-swing", type=float, default=0.0, metavar="A",
                   help="warp arrivals so the rate swings 1 -/+ A around its mean over a cosine cycle, trough first")
    w.add_argument("--swing-period", type=float, metavar="S", help="the swing's period (default: the arrivals' span)")
    w.add_argument("--tokens-per-id", type=int, default=512, help="tokens per trace hash id (shrink for small models)")
    c = p.add_argument_group("cluster")
    c.add_argument("--prefill-nodes", type=int, default=1, help="0 = colocated nodes only")
    c.add_argument("--decode-nodes", type=int, default=1)
    c.add_argument("--router-policy", default="prefix_aware", choices=sorted(POLICIES))
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--local-prefill-threshold", type=int, default=64)
    c.add_argument("--local-prefill-hit-ratio", type=float, default=0.8)
    c.add_argument("--profile", default="h100", help="cost profile: a JSON path or a name in cluster/tools/sim/profiles/")
    c.add_argument("--cost-mode", choices=["table", "fit", "fit+residual"],
                   help="how a measured profile predicts a step (default: the profile's own mode)")
    c.add_argument("--measure", action="store_true",
                   help="first time real CPU engine steps (tiny model) into a profile, and use it")
    c.add_argument("--measure-output", default="cpu_measured.json", help="where --measure writes the profile")
    c.add_argument("--block-size", type=int, default=512)
    c.add_argument("--num-blocks", type=int, help="KV blocks per node (default: the profile's capacity)")
    c.add_argument("--max-num-batched-tokens", type=int)
    c.add_argument("--max-num-seqs", type=int)
    c.add_argument("--report-interval", type=float, default=0.1, help="load + KV event reports (s)")
    c.add_argument("--report-lag", type=float, default=0.002, help="report delivery lag to the router (s)")
    c.add_argument("--no-collapse", action="store_true", help="one event per decode step (slow; for checks)")
    c.add_argument("--no-reserve-decode-blocks", action="store_true",
                   help="allocate a hand-off's decode blocks when its prefill ends, not when it is routed "
                        "(as `pdserve serve --no-reserve-decode-blocks`)")
    c.add_argument("--seed", type=int, default=0)
    _autoscale_flags(p)
    _output_flags(p)
    p.set_defaults(func=run)


def _autoscale_flags(p) -> None:
    a = p.add_argument_group("autoscaling (cluster/orchestration/autoscale on the virtual clock)")
    a.add_argument("--autoscale", action="store_true",
                   help="size both pools by the controller; --prefill-nodes / --decode-nodes are the starting sizes")
    a.add_argument("--slo-ttft-ms", type=float, help="TTFT target (ms; default --slo-ttft); also the goodput SLO")
    a.add_argument("--slo-itl-ms", type=float, help="mean ITL target (ms; default --slo-itl); also the goodput SLO")
    a.add_argument("--min-prefill-workers", type=int, default=1)
    a.add_argument("--max-prefill-workers", type=int, help="default: --prefill-nodes + --decode-nodes")
    a.add_argument("--min-decode-workers", type=int, default=1)
    a.add_argument("--max-decode-workers", type=int, help="default: --prefill-nodes + --decode-nodes")
    a.add_argument("--max-total-workers", type=int, help="both pools together (default: no cap)")
    a.add_argument("--autoscale-interval", type=float, default=5.0, help="controller interval (simulated s)")
    a.add_argument("--autoscale-window", type=float, default=30.0, help="signal window: rates, percentiles (s)")
    a.add_argument("--startup-delay", type=float, default=30.0,
                   help="a new worker takes requests this many simulated seconds after it is started")


def _output_flags(p) -> None:
    o = p.add_argument_group("output")
    o.add_argument("--slo-ttft", type=float, default=2.0)
    o.add_argument("--slo-itl", type=float, default=0.1)
    o.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help=f"sweep a parameter (repeatable; cartesian product); keys: {', '.join(SWEEP_KEYS)}; "
                        "pd=1:3 splits prefill+decode nodes 1:3")
    o.add_argument("--jobs", type=int, default=1, help="sweep runs simulated at once, one process each")
    o.add_argument("--progress", type=float, default=0.0, metavar="SIM_S",
                   help="every SIM_S simulated seconds print a progress line (JSON) to stderr; 0 = none")
    o.add_argument("--output", help="write all runs as JSON here")
    o.add_argument("--plot-dir", help="write PNG plots of the sweep here")


def parse_sweeps(specs: list[str]) -> dict[str, list]:
    out: dict[str, list] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in SWEEP_KEYS or not values:
            raise ValueError(f"--sweep {spec!r}: use KEY=V1,V2 with KEY one of {', '.join(SWEEP_KEYS)}")
        try:
            out[key] = [SWEEP_KEYS[key](v.strip()) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--sweep {spec!r}: values of {key} must be {SWEEP_KEYS[key].__name__}") from None
    return out


def split_pd(ratio: str, total: int) -> tuple[int, int]:
    a, sep, b = ratio.partition(":")
    try:
        fa, fb = float(a), float(b)
    except ValueError:
        fa = fb = -1.0
    if not sep or fa < 0 or fb <= 0:
        raise ValueError(f"pd={ratio!r}: give prefill:decode like 1:3 (decode part > 0)")
    p = round(total * fa / (fa + fb))
    p = min(max(p, 1 if fa > 0 else 0), total - 1)
    return p, total - p


def base_params(args) -> dict:
    return {"policy": args.router_policy, "copies": args.copies, "time_scale": args.time_scale,
            "num_blocks": args.num_blocks, "prefill_nodes": args.prefill_nodes, "decode_nodes": args.decode_nodes,
            "local_prefill_threshold": args.local_prefill_threshold, "rate_swing": args.rate_swing,
            "swing_period_s": args.swing_period}


def expand(base: dict, sweeps: dict[str, list]) -> list[dict]:
    runs = []
    keys = list(sweeps)
    for combo in itertools.product(*(sweeps[k] for k in keys)) if keys else [()]:
        p = dict(base)
        p.update(zip(keys, combo))
        if "pd" in p:
            p["prefill_nodes"], p["decode_nodes"] = split_pd(p["pd"], base["prefill_nodes"] + base["decode_nodes"])
        runs.append(p)
    return runs


def run(args) -> int:
    from cluster.tools.sim.cost_model import load_cost_model
    from cluster.tools.sim.workload import load_mooncake, swing_rate, synthetic_shared_prefix

    if (args.trace is None) == (args.synthetic is None):
        raise ValueError("give exactly one of --trace FILE or --synthetic N")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1 (sweep runs at once), got {args.jobs}")
    if args.measure:
        from cluster.tools.sim.measure import measure_profile
        measure_profile(args.measure_output)
        args.profile = args.measure_output
    cost = load_cost_model(args.profile)
    if args.cost_mode:
        cost = cost.with_mode(args.cost_mode)
    if args.trace:
        base_reqs = load_mooncake(args.trace, args.limit, tokens_per_id=args.tokens_per_id)
    else:
        base_reqs = synthetic_shared_prefix(args.synthetic, args.synthetic_rate, num_prefixes=8, prefix_ids=4,
                                            suffix_ids=2, output_length=64, tokens_per_id=args.tokens_per_id,
                                            seed=args.seed)
    swing_rate([], args.rate_swing, args.swing_period)      # a bad --rate-swing / --swing-period fails before any run
    sweeps = parse_sweeps(args.sweep)
    runs = expand(base_params(args), sweeps)
    results: list[dict | None] = [None] * len(runs)
    if args.jobs == 1 or len(runs) == 1:
        for i, params in enumerate(runs):
            results[i] = _report(params, simulate_one(params, args, cost, base_reqs))
    else:   # spawn: a clean interpreter per worker, the same on Linux and macOS
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(args.jobs, len(runs)), mp_context=ctx) as pool:
            futures = {pool.submit(simulate_one, params, args, cost, base_reqs): i for i, params in enumerate(runs)}
            for fut in as_completed(futures):
                i = futures[fut]
                results[i] = _report(runs[i], fut.result())
    doc = {"simulated": True, "trace": args.trace, "profile": cost.name,
           "profile_source": cost.meta.get("source"), "runs": results}
    if args.output:
        Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot_dir:
        from cluster.tools.sim.plots import write_plots
        for path in write_plots(results, set(sweeps), args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def slo_of(args):
    from cluster.tools.sim.metrics import Slo
    ttft = args.slo_ttft_ms / 1000.0 if getattr(args, "slo_ttft_ms", None) else args.slo_ttft
    itl = args.slo_itl_ms / 1000.0 if getattr(args, "slo_itl_ms", None) else args.slo_itl
    return Slo(ttft, itl)


def autoscale_of(args, prefill_nodes: int, decode_nodes: int):
    """The `SimAutoscale` the flags ask for (None without --autoscale)."""
    if not getattr(args, "autoscale", False):
        return None
    from cluster.orchestration.autoscale import AutoscaleConfig, PoolBounds
    from cluster.tools.sim.autoscale import SimAutoscale
    slo, fleet = slo_of(args), prefill_nodes + decode_nodes
    config = AutoscaleConfig(
        slo_ttft_ms=slo.ttft_s * 1000.0, slo_itl_ms=slo.itl_s * 1000.0,
        prefill=PoolBounds(args.min_prefill_workers, args.max_prefill_workers or fleet),
        decode=PoolBounds(args.min_decode_workers, args.max_decode_workers or fleet),
        max_total_workers=args.max_total_workers, predict_ahead_s=args.startup_delay,
        cooldown_out_s=max(args.startup_delay, args.autoscale_interval),
        idle_hold_s=max(0.0, 30.0 - args.autoscale_window))   # 30 s without a prompt, the window's included
    return SimAutoscale(config, interval_s=args.autoscale_interval, window_s=args.autoscale_window,
                        startup_s=args.startup_delay)


def simulate_one(params: dict, args, cost, base_reqs) -> dict:
    """One run of the sweep (module level: `--jobs` pickles it to a worker process)."""
    from cluster.tools.sim.cluster_sim import ClusterSim, SimConfig
    from cluster.tools.sim.workload import PromptBuilder, compress_time, overlay, swing_rate

    sched_meta = cost.meta.get("scheduler", {})
    reqs = swing_rate(overlay(compress_time(base_reqs, params["time_scale"]), params["copies"]),
                      params["rate_swing"], params["swing_period_s"])
    config = SimConfig(
        params["prefill_nodes"], params["decode_nodes"], policy=params["policy"],
        policy_config=PolicyConfig(args.temperature, params["local_prefill_threshold"],
                                   args.local_prefill_hit_ratio),
        block_size=args.block_size, num_blocks=params["num_blocks"],
        max_num_batched_tokens=args.max_num_batched_tokens or sched_meta.get("max_num_batched_tokens", 8192),
        max_num_seqs=args.max_num_seqs or sched_meta.get("max_num_seqs", 256),
        report_interval_s=args.report_interval, report_lag_s=args.report_lag,
        collapse=not args.no_collapse, reserve_decode_blocks=not args.no_reserve_decode_blocks,
        seed=args.seed, slo=slo_of(args),
        progress_s=args.progress, autoscale=autoscale_of(args, params["prefill_nodes"], params["decode_nodes"]))
    builder = PromptBuilder(args.block_size, args.tokens_per_id, seed=args.seed)
    return ClusterSim(config, cost, reqs, builder).run()


def _report(params: dict, summary: dict) -> dict:
    print(json.dumps({"params": params, **_headline(summary)}), flush=True)
    return {"params": params, "summary": summary}


def _headline(s: dict) -> dict:
    r3 = lambda x: None if x is None else round(x, 4)   # noqa: E731
    return {"finished": s["finished"], "requests": s["requests"], "ttft_mean_s": r3(s["ttft_s"]["mean"]),
            "ttft_p90_s": r3(s["ttft_s"]["p90"]), "itl_mean_s": r3(s["itl_s"]["mean"]),
            "itl_p90_s": r3(s["itl_s"]["p90"]), "goodput_rps": r3(s["goodput"]["requests_per_s"]),
            "hit_rate": r3(s["hit_rate_tokens"]), "transfer_gb": r3(s["transfer"]["bytes"] / 1e9),
            "util": {k: r3(v["mean"]) for k, v in s["utilisation"].items()},
            "worker_hours": r3(s["fleet"]["worker_hours"]["total"]), "good_requests": s["goodput"]["requests"],
            **({"peak_workers": s["autoscale"]["peak_workers"]} if "autoscale" in s else {}),
            "sim_s_per_wall_s": r3(s["sim"]["sim_s_per_wall_s"]), "wall_s": r3(s["sim"]["wall_s"])}

"""Autoscaled pools vs the best fixed prefill:decode split, on the simulator.

For each fleet size N: replays a window of the Mooncake conversation trace,
overlaid ``copies`` times (each copy its own cache salt: the simulator's
`overlay`) and compressed ``time_scale`` times to load the fleet; sweeps fixed
splits P + D = N; then runs the same trace with both pools sized by the
autoscaling controller (cluster/orchestration/autoscale, the module the live
head runs), starting from the split of N the capacity planner recommends for
the window's rate and mean lengths, split by the planner's `split_at_cap` (decode
holds the in-flight sequences of the busiest decode lifetime at the KV target,
prefill the rest: `--start planner`, cluster/tools/sim/autoscale.py
`planned_split`; `--start half`: N/2 : N/2; `--start P:D`: that split, a
diagnostic), optionally capped at
N workers in all (`--fleet-cap`). The simulator gives the controller the
wait-miss fraction (requests that miss TTFT by waiting although their prefill
alone fits it). Goodput = requests meeting both SLOs (TTFT and mean
ITL); best fixed split = most goodput, ties to fewer worker-hours. Prints one
JSON line.

    .venv/bin/python benchmarks/autoscale_sim.py --fleet 100:1000:12:1 --fleet 1000:300:120:1 --jobs 2
        (--fleet N:LIMIT:COPIES:TIME_SCALE, repeatable)

``--autoscaled-only`` runs the autoscaled arm alone (no fixed sweep: the fixed runs do not use the
controller, so a controller change leaves them as they were); its summary has no best split nor goal.
``--jobs 1`` runs in this process, in order. ``--rate-swing A`` warps every window's arrivals
(after the copies are overlaid) so that the rate swings between 1 - A and 1 + A of its mean over one
cosine cycle, trough first (cluster/tools/sim/workload.py `swing_rate`): the conversation trace's
own rate is level, so without it there is no load change for the controller to follow.

``--samples 0,1,2,...`` runs every arm (each fixed split and the autoscaled run) on every sample:
sample k is the trace's k-th window of LIMIT requests (lines k x LIMIT on; ``--sample-by seed``:
the first window with SimConfig.seed k instead, which moves nothing with the cost profiles here:
no step jitter, a router at temperature 0). With more than one sample the summary per fleet gives
per arm the mean and sd of good requests and worker-hours, the best fixed split by mean, the paired
per-sample difference autoscaled - best fixed and a held-out check (cluster/tools/sim/samples.py).
``--merge A.json B.json ...`` summarizes the runs of several ``--output`` files (chunks of samples
run apart) as one run would, and writes them without per-interval records.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from cluster.orchestration.autoscale import AutoscaleConfig, PoolBounds
from cluster.tools.sim.autoscale import SimAutoscale, planned_split
from cluster.tools.sim.cluster_sim import ClusterSim, SimConfig
from cluster.tools.sim.cost_model import load_cost_model
from cluster.tools.sim.metrics import Slo
from cluster.tools.sim.samples import summarize_samples
from cluster.tools.sim.workload import PromptBuilder, compress_time, load_mooncake, overlay, swing_rate

TRACE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


def one(args, fleet: dict, p: int, d: int, autoscale: bool, sample: int = 0) -> dict:
    cost = load_cost_model(args.profile)
    window = sample if args.sample_by == "window" else 0
    reqs = swing_rate(overlay(compress_time(load_mooncake(args.trace, fleet["limit"], offset=window * fleet["limit"]),
                                            fleet["time_scale"]), fleet["copies"]),
                      args.rate_swing, args.swing_period)
    n = fleet["nodes"]
    scale = None
    if autoscale:
        config = AutoscaleConfig(
            slo_ttft_ms=args.slo_ttft_ms * args.steer, slo_itl_ms=args.slo_itl_ms * args.steer,
            prefill=PoolBounds(max(1, n // 20), n), decode=PoolBounds(max(1, n // 20), n),
            max_total_workers=n if args.fleet_cap else None, decode_first_under_cap=args.decode_first,
            ttft_miss_budget=args.ttft_miss_budget if args.ttft_miss_budget > 0 else 0.002,
            predict_ahead_s=args.startup_delay, cooldown_out_s=max(args.startup_delay, args.interval),
            # a lull of --idle-hold seconds without a prompt (the simulator gives the controller the
            # time since the router last took one) sends both pools to their minimum
            idle_hold_s=args.idle_hold, target_kv_usage=args.target_kv_usage)
        scale = SimAutoscale(config, interval_s=args.interval, window_s=args.window, startup_s=args.startup_delay,
                             ttft_wait_misses=args.ttft_miss_budget > 0)
    sched = cost.meta.get("scheduler", {})
    chunk, seqs = sched.get("max_num_batched_tokens", 8192), sched.get("max_num_seqs", 256)
    if scale is not None and args.start == "planner":
        p, d = planned_split(n, reqs, cost, chunk, cost.kv_capacity_tokens // 512 * 512, seqs,
                             target_kv_usage=scale.config.target_kv_usage)
    elif scale is not None and args.start != "half":
        p, d = start_split(args.start, n)
    cfg = SimConfig(p, d, block_size=512, max_num_batched_tokens=chunk, max_num_seqs=seqs,
                    seed=sample if args.sample_by == "seed" else 0,
                    slo=Slo(args.slo_ttft_ms / 1000.0, args.slo_itl_ms / 1000.0), autoscale=scale,
                    reserve_decode_blocks=not args.no_reserve_decode_blocks)
    t0 = time.perf_counter()
    sim = ClusterSim(cfg, cost, reqs, PromptBuilder(512))
    s = sim.run()
    row = {"fleet": fleet["label"], "nodes": n, "split": f"{p}:{d}", "autoscale": autoscale, "sample": sample,
           "requests": s["requests"],
           "start_split": f"{p}:{d}",
           "finished": s["finished"], "good": s["goodput"]["requests"],
           "good_fraction": round(s["goodput"]["fraction"], 4),
           "worker_hours": round(s["fleet"]["worker_hours"]["total"], 3),
           "prefill_worker_hours": round(s["fleet"]["worker_hours"].get("prefill", 0.0), 3),
           "decode_worker_hours": round(s["fleet"]["worker_hours"].get("decode", 0.0), 3),
           "duration_s": round(s["duration_s"], 1), "ttft_p90_s": round(s["ttft_s"]["p90"], 3),
           "itl_p90_ms": round(s["itl_s"]["p90"] * 1000, 1), "wall_s": round(time.perf_counter() - t0, 1),
           "decode_reservations": s["sim"]["decode_reservations"],
           "local_recompute_fallbacks": s["sim"]["local_recompute_fallbacks"],
           "misses_by_arrival": misses_by_arrival(sim.records, sim.start_s, cfg.slo)}
    if autoscale:
        a = s["autoscale"]
        row.update(peak_workers=a["peak_workers"], decisions=a["decisions"], changes=len(a["changes"]),
                   first_changes=a["changes"][:12],
                   prefill_tokens_per_s_per_worker=a["prefill_tokens_per_s_per_worker"],
                   decode_seqs_per_worker=a["decode_seqs_per_worker"])
    print(json.dumps({"run": row}), file=sys.stderr, flush=True)
    if autoscale:
        row["intervals"] = s["autoscale"]["intervals"]      # in --output only: one row per controller interval
    return row


def start_split(spec: str, nodes: int) -> tuple[int, int]:
    """``--start P:D``: the autoscaled run's given starting split of a fleet of ``nodes`` (a
    diagnostic: where the planner's split would start it, started elsewhere)."""
    try:
        p, d = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--start: give planner, half or P:D (prefill:decode workers, e.g. 76:24), "
                         f"got {spec!r}") from None
    if p < 1 or d < 1 or p + d != nodes:
        raise ValueError(f"--start {spec}: give at least one worker per pool and P + D = the fleet's "
                         f"{nodes} nodes (run fleets of other sizes apart)")
    return p, d


def misses_by_arrival(records: list, start_s: float, slo: Slo, bin_s: float = 50.0) -> dict[str, list[int]]:
    """Per ``bin_s`` of arrival time (the bin's first second, from the run's start): the finished
    requests that missed only TTFT, only the mean ITL, both, and all finished (goodput's SLOs):
    where in the trace one run loses requests against another."""
    out: dict[str, list[int]] = {}
    for r in records:
        if r.finish_s is None:
            continue
        ttft, itl = r.ttft > slo.ttft_s, r.mean_itl is not None and r.mean_itl > slo.itl_s
        row = out.setdefault(str(int((r.arrival_s - start_s) // bin_s * bin_s)), [0, 0, 0, 0])
        if ttft or itl:
            row[2 if ttft and itl else 0 if ttft else 1] += 1
        row[3] += 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def plan_jobs(fleets: list[dict], fractions: list[float], autoscaled_only: bool,
              samples: list[int] | None = None) -> list[tuple]:
    """(fleet, prefill, decode, autoscale, sample) per run: per sample, the fixed splits P + D = N at
    each prefill fraction (none with ``autoscaled_only``), then the autoscaled run (N/2 : N/2 unless
    the planner starts it)."""
    jobs: list[tuple] = []
    for f in fleets:
        n = f["nodes"]
        splits = sorted({(max(1, round(n * x)), n - max(1, round(n * x))) for x in fractions})
        for k in samples or [0]:
            if not autoscaled_only:
                jobs += [(f, p, d, False, k) for p, d in splits]
            jobs.append((f, n // 2, n - n // 2, True, k))
    return jobs


def summarize(f: dict, mine: list[dict]) -> dict:
    """One fleet's summary: the autoscaled run, and with a fixed sweep the best split (most good
    requests, ties to fewer worker-hours), the sweep and whether the goal is met; over several
    samples, cluster/tools/sim/samples.py's figures."""
    if len({r["sample"] for r in mine}) > 1:
        return {"window": f, "requests": {str(r["sample"]): r["requests"] for r in mine if r["autoscale"]},
                **summarize_samples(mine)}
    auto = next(r for r in mine if r["autoscale"])
    out = {"window": f, "requests": auto["requests"],
           "autoscaled": {k: auto[k] for k in ("start_split", "good", "good_fraction", "worker_hours",
                                               "prefill_worker_hours", "decode_worker_hours", "ttft_p90_s",
                                               "itl_p90_ms", "duration_s", "peak_workers", "changes")}}
    fixed = [r for r in mine if not r["autoscale"]]
    if not fixed:
        return out
    best = max(fixed, key=lambda r: (r["good"], -r["worker_hours"]))
    out.update(best_fixed={k: best[k] for k in ("split", "good", "good_fraction", "worker_hours", "ttft_p90_s",
                                                "itl_p90_ms", "duration_s")},
               sweep=[{k: r[k] for k in ("split", "good", "worker_hours", "ttft_p90_s", "itl_p90_ms",
                                         "local_recompute_fallbacks")} for r in fixed],
               goal_met=auto["good"] >= best["good"] and auto["worker_hours"] < best["worker_hours"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--fleet", action="append", default=[], metavar="N:LIMIT:COPIES:TIME_SCALE")
    ap.add_argument("--prefill-fractions", default="0.3,0.4,0.5,0.6,0.7")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=100.0)
    ap.add_argument("--steer", type=float, default=0.75,
                    help="the controller steers each p90 to this part of its SLO (goodput counts the SLO itself)")
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--startup-delay", type=float, default=30.0)
    ap.add_argument("--idle-hold", type=float, default=10.0,
                    help="seconds without a prompt before both autoscaled pools drain to their minimum "
                         "(the trace's longest gap between arrivals is 2.7 s at 1750 requests)")
    ap.add_argument("--target-kv-usage", type=float, default=0.75,
                    help="decode's KV target (the controller's KV-room rule, its trade at the cap and the "
                         "planner's start split)")
    ap.add_argument("--rate-swing", type=float, default=0.0, metavar="A",
                    help="warp each window's arrivals so the rate swings 1 -/+ A around its mean over a cosine "
                         "cycle, trough first (the trace's rate is level; 0: as it is)")
    ap.add_argument("--swing-period", type=float, default=None, metavar="S",
                    help="the swing's period in seconds (default: the window's span, one cycle)")
    ap.add_argument("--fleet-cap", action="store_true", help="cap both autoscaled pools together at N")
    ap.add_argument("--decode-first", action="store_true",
                    help="at the fleet cap, decode's growth first (it may displace prefill workers)")
    ap.add_argument("--start", default="planner", metavar="planner|half|P:D",
                    help="the autoscaled run's starting split: the planner's ratio of N, N/2 : N/2, or "
                         "P prefill and D decode workers (P + D = N: a diagnostic)")
    ap.add_argument("--ttft-miss-budget", type=float, default=0.002,
                    help="part of the requests that may miss TTFT by waiting before prefill grows "
                         "(0: the simulator gives no wait-miss fraction; the TTFT p90 decides)")
    ap.add_argument("--no-reserve-decode-blocks", action="store_true",
                    help="allocate a hand-off's decode blocks when its prefill ends (the live cluster reserves "
                         "them when it is routed, by default)")
    ap.add_argument("--autoscaled-only", action="store_true",
                    help="run the autoscaled arm alone, no fixed sweep (for a controller change: the fixed "
                         "runs do not use the controller)")
    ap.add_argument("--jobs", type=int, default=2, help="processes (1: in this one, in order)")
    ap.add_argument("--samples", default="0", metavar="K,K,...",
                    help="run every arm on each sample: the trace's K-th window of LIMIT requests")
    ap.add_argument("--sample-by", choices=("window", "seed"), default="window",
                    help="what a sample changes: the trace window, or SimConfig.seed on the first window")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="summarize the runs of these --output files together (no simulation)")
    ap.add_argument("--output", help="also write every run here (JSON)")
    args = ap.parse_args(argv)
    fleets = []
    for spec in args.fleet or ["100:1000:12:1", "1000:300:120:1"]:
        n, limit, copies, ts = spec.split(":")
        fleets.append({"label": spec, "nodes": int(n), "limit": int(limit), "copies": int(copies),
                       "time_scale": float(ts)})
    if args.merge:
        return merge(args.merge, args.output)
    if args.start not in ("planner", "half"):
        for f in fleets:
            start_split(args.start, f["nodes"])          # a bad --start fails before any run
    fractions = [float(x) for x in args.prefill_fractions.split(",")]
    samples = [int(x) for x in args.samples.split(",")]
    if len(set(samples)) != len(samples) or min(samples) < 0:
        raise ValueError(f"--samples: give distinct sample numbers >= 0, e.g. 0,1,2 (got {args.samples})")
    jobs = [(args, *j) for j in plan_jobs(fleets, fractions, args.autoscaled_only, samples)]
    t0 = time.perf_counter()
    if args.jobs == 1:
        rows = [one(*j) for j in jobs]
    else:
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows = list(pool.map(one, *zip(*jobs)))
    out = {"slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms}, "steer": args.steer,
           "profile": args.profile, "fleet_cap": args.fleet_cap, "decode_first": args.decode_first,
           "start": args.start, "ttft_miss_budget": args.ttft_miss_budget,
           "reserve_decode_blocks": not args.no_reserve_decode_blocks,
           "target_kv_usage": args.target_kv_usage, "startup_delay_s": args.startup_delay,
           "interval_s": args.interval, "idle_hold_s": args.idle_hold,
           "rate_swing": args.rate_swing, "swing_period_s": args.swing_period,
           "autoscaled_only": args.autoscaled_only, "samples": samples, "sample_by": args.sample_by,
           "fleets": {f["label"]: summarize(f, [r for r in rows if r["fleet"] == f["label"]]) for f in fleets}}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.output:
        Path(args.output).write_text(json.dumps({"summary": out, "runs": rows}, indent=1) + "\n")
    print(json.dumps(out))


def merge(paths: list[str], output: str | None) -> None:
    """One summary over the runs of several ``--output`` files of the same settings (chunks of
    samples, or of fleets, run apart); the runs written without per-interval records."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    settings = [{k: v for k, v in p["summary"].items() if k not in ("fleets", "wall_s", "samples")} for p in parts]
    if any(s != settings[0] for s in settings):
        raise ValueError(f"--merge: {paths} were run with different settings; merge outputs of one command "
                         "line that differ only in --samples or --fleet")
    fleets = {label: f["window"] for p in parts for label, f in p["summary"]["fleets"].items()}
    rows = [{k: v for k, v in r.items() if k not in ("intervals", "first_changes")} for p in parts for r in p["runs"]]
    out = {**settings[0], "samples": sorted({r["sample"] for r in rows}), "merged": paths,
           "wall_s": round(sum(p["summary"]["wall_s"] for p in parts), 1),
           "fleets": {label: summarize(f, [r for r in rows if r["fleet"] == label]) for label, f in fleets.items()}}
    if output:
        Path(output).write_text(json.dumps({"summary": out, "runs": rows}, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

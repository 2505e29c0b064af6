"""Per-step cost-model error of the simulator against real CPU engine steps.

Measures a profile (`cluster.tools.sim.measure`: grid of pure prefill / decode
cells plus multi-prompt prefills and mixed steps, thread CPU time, per cell
the fastest of rounds x repeats timings spread over shuffled rounds), and in the same interleaved rounds
real steps at *off-grid* probe shapes: pure prefills and decodes between the
grid points, multi-prompt prefills and mixed prefill+decode steps. Compares
each probe with the prediction of every mode (table, fit, fit+residual).

The same timings give one profile per ``--estimators`` entry: a cell's cost
(grid cells and probes alike) as the fastest of all its timings (``min``) or
as the median round's fastest (``median_round_min``), so both can be compared
on one run.

Prints one JSON line (``--table`` also prints a markdown table to stderr):

    .venv/bin/python benchmarks/sim_cost_error.py [--model tiny|PATH] [--repeats 5] [--rounds 4] [--table]
    .venv/bin/python benchmarks/sim_cost_error.py --model PATH --decode-sweep 1,2,3,4,5,6,8

``tiny`` (default) is the random tiny Llama of cluster/tools/tiny_models.py; any
other value is a model path (HF directory or .gguf; "" = SmolLM2).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from cluster.tools.sim.cost_model import FIT_MODES, TableCostModel
from cluster.tools.sim.measure import (ESTIMATORS, Cell, Grid, StepTimer, build_profile, make_engine,
                                 measure_rounds, time_cells)
from cluster.tools.sim.step_fit import shape_sched

TINY_GRID = Grid(prefill_new=(8, 16, 32, 64, 128, 256, 512), prefill_cached=(0, 128, 512, 1024),
                 decode_batch=Grid.decode_batch, decode_context=(64, 256, 1024, 1920))
PROBES = [
    Cell("prefill", ((24, 0),)), Cell("prefill", ((48, 384),)), Cell("prefill", ((96, 64),)),
    Cell("prefill", ((200, 700),)), Cell("prefill", ((384, 256),)), Cell("prefill", ((12, 900),)),
    Cell("decode", (3, 200)), Cell("decode", (6, 900)), Cell("decode", (12, 1800)), Cell("decode", (24, 600)),
    Cell("prefill", ((40, 64),) * 3), Cell("prefill", ((100, 0), (20, 300))),
    Cell("mixed", (4, 512, 64, 0)), Cell("mixed", (8, 1600, 100, 256)),
]


def errors(profile: TableCostModel, measured: dict) -> dict[str, list[dict]]:
    """Per mode: each probe's predicted and real seconds and relative error."""
    out = {}
    for mode in FIT_MODES:
        m = profile.with_mode(mode)
        rows = []
        for cell, (shape, real) in measured.items():
            pred = m.step_seconds(shape_sched(shape))
            rows.append({"probe": cell.label, "predicted_ms": round(pred * 1e3, 4),
                         "real_ms": round(real * 1e3, 4), "error": round(abs(pred - real) / real, 4)})
        out[mode] = rows
    return out


def tiny_model_dir() -> str:
    from cluster.tools.tiny_models import make_tiny_model
    return str(make_tiny_model(tempfile.mkdtemp(prefix="pdserve-tiny-"), "llama"))


def decode_sweep(engine, batches: list[int], args) -> None:
    cells = [Cell("decode", (b, ctx)) for b in batches for ctx in (64, 200, 256)]
    got = time_cells(StepTimer(engine, args.seed), cells, args.repeats, args.rounds, args.seed)
    print(json.dumps({"benchmark": "sim_cost_error", "phase": "decode_sweep", "model": args.model,
                      "clock": "thread_time", "repeats": args.repeats, "rounds": args.rounds,
                      "ms": {c.label: round(got[c][1] * 1e3, 3) for c in cells}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--table", action="store_true", help="also print a markdown table to stderr")
    ap.add_argument("--estimators", default="median_round_min,min",
                    help=f"how a cell's timings give its cost, any of {ESTIMATORS} (`cluster.tools.sim.measure.pick`); "
                         "one set of timings, a profile and probe errors per estimator; the first is printed in full")
    ap.add_argument("--decode-sweep", metavar="B1,B2,...",
                    help="instead: time decode steps at these batch sizes (contexts 64, 200, 256; fastest of "
                         "rounds x repeats) and print them, to see how the cost moves between grid batches")
    args = ap.parse_args()
    estimators = args.estimators.split(",")
    if not set(estimators) <= set(ESTIMATORS):       # before a measurement of many minutes
        ap.error(f"--estimators: each must be one of {ESTIMATORS}, got {args.estimators!r}")
    model = tiny_model_dir() if args.model == "tiny" else args.model
    engine = make_engine(model, num_blocks=1024, max_model_len=2048, max_num_batched_tokens=1024)
    if args.decode_sweep:
        decode_sweep(engine, [int(b) for b in args.decode_sweep.split(",")], args)
        return
    grid = Grid(**{**TINY_GRID.__dict__, "repeats": args.repeats, "rounds": args.rounds})
    t0 = time.perf_counter()
    rounds = measure_rounds(engine, grid, seed=args.seed, probes=PROBES)
    wall = time.perf_counter() - t0
    # one set of timings; a profile (and the probes' real steps) per estimator, the first one printed in full
    by_est = {}
    for est in estimators:
        profile, measured = build_profile(engine, grid, rounds, est, probes=PROBES)
        errs = errors(profile, measured)
        summary = {mode: {"median_error": statistics.median(r["error"] for r in rows),
                          "mean_error": round(statistics.fmean(r["error"] for r in rows), 4),
                          "max_error": max(r["error"] for r in rows),
                          "under_5pct": sum(r["error"] < 0.05 for r in rows)} for mode, rows in errs.items()}
        by_est[est] = (profile, errs, summary)
    est = estimators[0]
    profile, errs, summary = by_est[est]
    print(json.dumps({"benchmark": "sim_cost_error", "model": args.model, "clock": "thread_time",
                      "repeats": args.repeats, "rounds": args.rounds, "probes": len(PROBES), "estimator": est,
                      "summary": summary, "fit": dict(zip(profile.step_fit.to_json()["terms"],
                                                          profile.step_fit.coef)),
                      "measure_wall_s": round(wall, 1), "rows": errs,
                      "other_estimators": {e: {"summary": v[2], "rows": v[1]} for e, v in by_est.items() if e != est},
                      "round_ms": {c.label: [round(t * 1e3, 4) for _, t in v] for c, v in rounds.items()
                                   if c in PROBES}}))
    for e, (_, _, summ) in by_est.items():
        s = summ["fit+residual"]
        print(f"estimator {e}: fit+residual median {s['median_error']:.1%} max {s['max_error']:.1%}, "
              f"{s['under_5pct']} / {len(PROBES)} probes under 5%", file=sys.stderr)
    if args.table:
        modes = list(errs)
        print("| probe | real ms | " + " | ".join(f"{m} ms (err)" for m in modes) + " |", file=sys.stderr)
        print("|---|---|" + "---|" * len(modes), file=sys.stderr)
        for i, row in enumerate(errs[modes[0]]):
            cells = [f"{errs[m][i]['predicted_ms']:.3f} ({errs[m][i]['error']:.1%})" for m in modes]
            print(f"| {row['probe']} | {row['real_ms']:.3f} | " + " | ".join(cells) + " |", file=sys.stderr)
        print("| **median error** | | " + " | ".join(f"**{summary[m]['median_error']:.1%}**" for m in modes)
              + " |", file=sys.stderr)


if __name__ == "__main__":
    main()

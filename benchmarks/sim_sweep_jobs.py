"""A simulator sweep run serially and with worker processes, side by side.

Runs the same `pdserve simulate ... --sweep policy=...` with `--jobs 1` and
`--jobs N` (each a fresh process), times both, and checks that the two outputs
are identical apart from the wall-time fields. Prints one JSON line.

    .venv/bin/python benchmarks/sim_sweep_jobs.py [--jobs 2 --limit 500 --time-scale 4 --copies 62 \\
        --prefill-nodes 500 --decode-nodes 500]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster.tools.sim.cli import without_wall

ROOT = Path(__file__).resolve().parents[1]

TRACE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--limit", type=int, default=500)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--copies", type=int, default=62)
    ap.add_argument("--prefill-nodes", type=int, default=500)
    ap.add_argument("--decode-nodes", type=int, default=500)
    ap.add_argument("--sweep", default="policy=prefix_aware,least_loaded,round_robin")
    args = ap.parse_args()
    out, docs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for jobs in (1, args.jobs):
            path = Path(tmp) / f"jobs{jobs}.json"
            cmd = [sys.executable, "-m", "cluster.cli", "simulate", "--trace", args.trace,
                   "--limit", str(args.limit), "--time-scale", str(args.time_scale), "--copies", str(args.copies),
                   "--prefill-nodes", str(args.prefill_nodes), "--decode-nodes", str(args.decode_nodes),
                   "--sweep", args.sweep, "--jobs", str(jobs), "--output", str(path)]
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            out[f"wall_s_jobs{jobs}"] = round(time.perf_counter() - t0, 2)
            docs[jobs] = json.loads(path.read_text())
    out["speedup"] = round(out["wall_s_jobs1"] / out[f"wall_s_jobs{args.jobs}"], 3)
    out["identical_apart_from_wall"] = without_wall(docs[1]) == without_wall(docs[args.jobs])
    out["runs"] = len(docs[1]["runs"])
    out["args"] = vars(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

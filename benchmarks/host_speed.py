"""How steady is this host's speed? A fixed unit of work, timed over and over.

The simulator's validation against real pdserve (benchmarks/sim_validation.py)
needs real runs that repeat: near capacity a few percent of step cost is tens
of percent of latency. This script measures the host itself, with nothing of
pdserve in it: ``--procs`` processes (default: one per core) each repeat a
fixed unit of work (a float32 matmul the size of the validation model's MLP
at batch 4, and a pure-Python loop) for ``--seconds``, and every ``--window``
seconds record how many units they did per second of *thread CPU time*. CPU
time, not wall time, so waiting for a core does not count: what moves is how
fast the core runs while it is ours (other tenants of the physical machine,
its clock, its shared caches).

Prints one JSON line: per kind of work, the windows' rates (units per CPU
second) with their median, min, max, spread ((max - min) / median) and
coefficient of variation, plus the host's steal time over the run
(``/proc/stat``), side by side for the matmul and the Python loop.

    .venv/bin/python benchmarks/host_speed.py [--seconds 120] [--window 5] [--procs 2] [--kinds matmul,python]

Bounded: stops by itself after ``--seconds``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time


def _matmul_unit():
    import torch
    torch.set_num_threads(1)
    x = torch.randn(4, 512)
    w1, w2 = torch.randn(512, 1536), torch.randn(1536, 512)

    def unit() -> None:
        for _ in range(20):
            (x @ w1).relu_() @ w2
    return unit


def _python_unit():
    def unit() -> None:
        n = 0
        for i in range(20000):
            n += i & 7
    return unit


def _worker(kind: str, seconds: float, window: float, out) -> None:
    unit = _matmul_unit() if kind == "matmul" else _python_unit()
    for _ in range(20):         # warm-up
        unit()
    rates: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        done, c0, w0 = 0, time.thread_time(), time.monotonic()
        while time.monotonic() - w0 < window:
            unit()
            done += 1
        rates.append(done / max(time.thread_time() - c0, 1e-9))
    out.put(rates)


def _steal() -> int:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) if len(fields) > 8 else 0


def summarise(rates: list[float]) -> dict:
    """Median / min / max of per-window rates, their spread relative to the
    median and their coefficient of variation."""
    if not rates:
        raise ValueError("no windows measured: raise --seconds above --window")
    med = statistics.median(rates)
    return {"windows": len(rates), "median": round(med, 2), "min": round(min(rates), 2),
            "max": round(max(rates), 2), "spread": round((max(rates) - min(rates)) / med, 4),
            "cv": round(statistics.pstdev(rates) / statistics.mean(rates), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120.0, help="per kind of work")
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--procs", type=int, default=mp.cpu_count())
    ap.add_argument("--kinds", default="matmul,python", help="comma-separated: matmul, python")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - {"matmul", "python"}:
        raise SystemExit(f"--kinds takes matmul and/or python, got {args.kinds!r}")
    if args.seconds < args.window or args.window <= 0 or args.procs < 1:
        raise SystemExit("need --seconds >= --window > 0 and --procs >= 1")
    result: dict = {"bench": "host_speed", "procs": args.procs, "window_s": args.window}
    steal0, ticks = _steal(), os.sysconf("SC_CLK_TCK")     # /proc/stat counts in clock ticks
    for kind in kinds:
        q: mp.Queue = mp.Queue()
        procs = [mp.Process(target=_worker, args=(kind, args.seconds, args.window, q)) for _ in range(args.procs)]
        for p in procs:
            p.start()
        per_proc = [q.get() for _ in procs]
        for p in procs:
            p.join()
        result[kind] = {"all": summarise([r for rs in per_proc for r in rs]),
                        "per_proc": [summarise(rs) for rs in per_proc]}
    result["steal_s"] = round((_steal() - steal0) / ticks, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

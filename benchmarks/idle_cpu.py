"""What an idle pdserve cluster costs: cores kept busy with no requests in flight.

Starts --prefill-workers (4) prefill + --decode-workers (1) decode workers on the
bundled SmolLM2 (the routing benchmark's shape: Ray actors, one CPU each), sends
--warm-requests (4) short requests so every worker has run a step and the KV
transfer paths have been used, waits --settle-s, then reads CPU seconds (user +
system, /proc) of every process and thread of the run over --window-s of idle.

Reported: cores busy in total; per process kind (driver: the serve process with the
frontend, router and report polling; prefill / decode: the worker actors; ray: Ray's
own processes (GCS, raylet, its idle workers, log monitor), not pdserve's code); the
busiest threads by name (/proc/<pid>/task/<tid>/comm), with the process kind; and the
host's busy cores over the same window (other sessions' jobs included). Then
`ttft_after_idle_ms`: --after-idle-requests pairs [TTFT of a request sent after
--settle-s of idle, TTFT of the same shape sent at once after it]: what the idle
back-offs cost the first request.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/idle_cpu.py [--window-s 10]

Prints one JSON line. Compare two trees in one run: run it once per tree
(PYTHONPATH=<tree>) back to back under the heavy lock.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from cluster.config import ServeConfig  # noqa: E402
from cluster.server_stack import start_stack  # noqa: E402
from cluster.tools.bench import datasets as ds  # noqa: E402
from cluster.tools.bench.runner import RunnerConfig, run_load  # noqa: E402
from disagg_vs_colocated import free_port, machine  # noqa: E402
from process_cpu import _host_busy_s, descendants, thread_cpu_s  # noqa: E402


def _comm(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def threads(kinds: dict[int, str]) -> dict[tuple[str, int, int], tuple[str, float]]:
    """(kind, pid, tid) -> (thread name, CPU seconds so far) for every thread of every process."""
    out = {}
    for pid, kind in kinds.items():
        for tid, s in thread_cpu_s(pid).items():
            out[(kind, pid, tid)] = (_comm(f"/proc/{pid}/task/{tid}/comm"), s)
    return out


def window(kinds: dict[int, str], seconds: float) -> dict:
    t0, h0, a = time.monotonic(), _host_busy_s(), threads(kinds)
    time.sleep(seconds)          # the serve loop is idle too: nothing else runs on this thread's loop
    b, wall, host = threads(kinds), time.monotonic() - t0, _host_busy_s() - h0
    used = {k: s - a.get(k, (n, s))[1] for k, (n, s) in b.items() if k in a}
    per_kind: dict[str, float] = defaultdict(float)
    per_name: dict[tuple[str, str], float] = defaultdict(float)
    for (kind, _, _), s in used.items():
        per_kind[kind] += s
    for k, s in used.items():
        per_name[(k[0], b[k][0])] += s
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:12]
    total = sum(per_kind.values())
    return {"wall_s": round(wall, 2), "cores_busy": round(total / wall, 3),
            "cores_busy_pdserve": round((total - per_kind.get("ray", 0.0)) / wall, 3),
            "cores_busy_by_kind": {k: round(v / wall, 3) for k, v in sorted(per_kind.items())},
            "top_threads_cores": [{"kind": k, "thread": n, "cores": round(s / wall, 3)} for (k, n), s in top],
            "host_cores_busy": round(host / wall, 2)}


async def ttft_pairs(target: str, vocab_size: int, args) -> list[list[float]]:
    """--after-idle-requests times: idle --settle-s, then one request (its TTFT after the idle
    spell, when every back-off is at its longest) and the same shape at once (the warm TTFT)."""
    pairs = []
    for i in range(args.after_idle_requests):
        await asyncio.sleep(args.settle_s)
        pair = []
        for j in range(2):
            req = ds.random_dataset(ds.RandomSpec(64, 2), 1, vocab_size, 1000 + 2 * i + j)
            res = await run_load(target, req, [0.0], RunnerConfig(progress=False))
            pair.append(round(1000 * (res.results[0].ttft_s or float("nan")), 1))
        pairs.append(pair)
    return pairs


async def main_async(args) -> dict:
    import ray

    cfg = ServeConfig(model=args.model, grpc_port=free_port(), metrics_port=0, http_port=0, torch_threads=1,
                      cpus_per_worker=1.0, prefill_workers=args.prefill_workers,
                      decode_workers=args.decode_workers, local_prefill_threshold=0,
                      local_prefill_hit_ratio=1.0, log_level="WARNING",
                      ray_temp_dir=tempfile.mkdtemp(prefix="pdserve-idle-ray-"))
    stack = await start_stack(cfg)
    try:
        info = stack.backend.model_info()
        warm = ds.random_dataset(ds.RandomSpec(64, 2), args.warm_requests, info.vocab_size, 12345)
        await run_load(stack.grpc.target, warm, [0.0] * len(warm), RunnerConfig(progress=False))
        kinds = {os.getpid(): "driver"}
        for ref in stack.backend.workers.values():
            kinds[(await ref.actor.ready.remote()).pid] = ref.pool
        kinds.update({p: "ray" for p in descendants(os.getpid()) if p not in kinds})
        await asyncio.sleep(args.settle_s)
        # measured on another thread so the serve loop (report polling, streams) runs as when idle
        idle = await asyncio.to_thread(window, kinds, args.window_s)
        if args.hold_s:      # for a profiler: `py-spy dump --pid <pid>` while the cluster stays idle
            print(json.dumps({"hold_s": args.hold_s, "pids": {str(p): k for p, k in kinds.items()}}),
                  file=sys.stderr, flush=True)
            await asyncio.sleep(args.hold_s)
        idle["ttft_after_idle_ms"] = await ttft_pairs(stack.grpc.target, info.vocab_size, args)
    finally:
        await stack.drain_and_stop(1.0)
        ray.shutdown()
    return {"benchmark": "idle_cpu", "machine": machine(),
            "shape": {"prefill_workers": args.prefill_workers, "decode_workers": args.decode_workers,
                      "transfer_backend": cfg.transfer_backend}, **idle}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF dir or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--prefill-workers", type=int, default=4)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--warm-requests", type=int, default=4)
    p.add_argument("--settle-s", type=float, default=3.0)
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--hold-s", type=float, default=0.0, help="keep the idle cluster up this long after the "
                   "window (its pids on stderr), e.g. to dump stacks with py-spy")
    p.add_argument("--after-idle-requests", type=int, default=3, help="after the window: this many times, "
                   "idle --settle-s, then a request and another at once; their TTFTs (ms) as pairs")
    args = p.parse_args()
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()

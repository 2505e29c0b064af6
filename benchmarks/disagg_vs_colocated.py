"""Disaggregated vs colocated serving on the same hardware budget, side by side.

Both modes get two workers of one torch thread and one Ray CPU each, every
worker pinned to its own core: 1 prefill + 1 decode worker (disaggregated)
against 2 colocated workers that do both phases. The workload is the one
disaggregation is for: steady decode streams (a closed loop of --streams
short-prompt, long-output requests) while long prompts arrive (Poisson at
--long-rate). Reported for each mode: the streams' inter-token latency
p50/p99 (gaps inside the measuring window only), the long prompts' TTFT
p50/p99, the streams' TTFT, throughput; and disaggregated/colocated ratios.

Pinning: after the workers load, every thread of each worker process is
pinned with os.sched_setaffinity (worker i -> core i), from this process; the
frontend and the load generator run here, unpinned. The workers are not
edited. Conditional disaggregation keeps the server defaults, so the streams'
short prompts prefill on the decode worker and long prompts on the prefill
worker. Both modes chunk prefills at --max-num-batched-tokens (256) tokens per
engine step, the usual way a colocated server bounds the stall a long prompt
causes; pass 2048 (the server default) to see colocated without it.

    .venv/bin/python benchmarks/disagg_vs_colocated.py [--duration 30] [--model ""]

Prints one JSON line. Figures vary with the machine's load: compare the two
modes of one run, not runs of different days.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from cluster.tools.bench import arrivals, datasets as ds  # noqa: E402
from cluster.tools.bench.report import latency_stats  # noqa: E402
from cluster.tools.bench.runner import RunnerConfig, run_load  # noqa: E402
from cluster.config import ServeConfig  # noqa: E402
from cluster.server_stack import start_stack  # noqa: E402


def free_port() -> int:
    """A free TCP port for the stack's gRPC endpoint (grpc_port 0 turns gRPC off)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "loadavg_1m": os.getloadavg()[0],
            "python": platform.python_version()}


async def pin_workers(stack) -> dict[str, int]:
    """Pin every thread of worker i to core i (the workers' own code is not touched)."""
    cores = sorted(os.sched_getaffinity(0))
    pinned = {}
    for i, wid in enumerate(sorted(stack.backend.workers)):
        pid = (await stack.backend.workers[wid].actor.ready.remote())["pid"]
        core = cores[i % len(cores)]
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {core})
            except (ProcessLookupError, PermissionError):
                pass
        pinned[wid] = core
    return pinned


def window_itl(results, start_s: float, end_s: float) -> list[float]:
    """Inter-token gaps whose token arrived inside [start_s, end_s]."""
    out = []
    for r in results:
        if not r.itl_s:
            continue
        times = r.token_times_s[len(r.token_times_s) - len(r.itl_s):]
        out.extend(g for t, g in zip(times, r.itl_s) if start_s <= t <= end_s)
    return out


async def run_mode(name: str, cfg: ServeConfig, args) -> dict:
    import ray

    t0 = time.monotonic()
    stack = await start_stack(cfg)
    try:
        pinned = await pin_workers(stack)
        target, vocab = stack.grpc.target, stack.backend.model_info().vocab_size
        quiet = RunnerConfig(progress=False, drain_timeout_s=120)
        warm = ds.random_dataset(ds.RandomSpec(args.long_len, 2), 2, vocab, 99) + \
            ds.random_dataset(ds.RandomSpec(args.stream_prompt, 4), 2, vocab, 98)
        await run_load(target, warm, [0.0] * len(warm), quiet)
        ready_s = time.monotonic() - t0
        n_streams = args.streams * (1 + math.ceil(args.duration * 20 / args.stream_output))
        streams = ds.random_dataset(ds.RandomSpec(args.stream_prompt, args.stream_output), n_streams, vocab, 1)
        n_long = max(1, math.ceil(args.long_rate * args.duration * 2))
        longs = ds.random_dataset(ds.RandomSpec(args.long_len, args.long_output), n_long, vocab, 2)
        offsets = [args.settle + t for t in arrivals.schedule(arrivals.ArrivalSpec(args.long_rate), n_long, 3)]
        s_run, l_run = await asyncio.gather(
            run_load(target, streams, [0.0] * n_streams,
                     RunnerConfig(max_concurrency=args.streams, duration_s=args.duration, progress=False)),
            run_load(target, longs, offsets, RunnerConfig(duration_s=args.duration, progress=False)))
    finally:
        await stack.drain_and_stop(1.0)
        ray.shutdown()
    ok_s = [r for r in s_run.results if r.ok]
    ok_l = [r for r in l_run.results if r.ok]
    pick = (lambda st: {k: st[k] for k in ("count", "p50", "p99", "mean")})
    return {
        "workers": sorted(pinned), "pinned_cores": pinned, "startup_s": round(ready_s, 1),
        "stream_itl_ms": pick(latency_stats(window_itl(ok_s, args.settle, args.duration))),
        "long_ttft_ms": pick(latency_stats(r.ttft_s for r in ok_l)),
        "stream_ttft_ms": pick(latency_stats(r.ttft_s for r in ok_s)),
        "stream_output_tok_s": sum(r.output_tokens for r in ok_s) / max(s_run.elapsed_s, 1e-9),
        "long_prompts_finished": len(ok_l), "streams_finished": len(ok_s),
        "failures": dict(Counter(r.error_code for r in s_run.results + l_run.results if not r.ok)),
    }


def ratio(a: dict, b: dict, key: str, p: str) -> float | None:
    x, y = a[key][p], b[key][p]
    return round(x / y, 3) if x is not None and y else None


async def main_async(args) -> dict:
    base = dict(model=args.model, grpc_port=free_port(), metrics_port=0, http_port=0, torch_threads=1,
                cpus_per_worker=1.0, num_kv_blocks=args.kv_blocks, max_model_len=args.max_model_len, dtype=args.dtype,
                max_num_batched_tokens=args.max_num_batched_tokens,
                ray_temp_dir=tempfile.mkdtemp(prefix="pdserve-bench-ray-"), log_level="WARNING")
    modes = {"disaggregated": ServeConfig(**base, prefill_workers=1, decode_workers=1),
             "colocated": ServeConfig(**base, colocated=True, prefill_workers=0, decode_workers=2)}
    order = ["colocated", "disaggregated"] if args.colocated_first else ["disaggregated", "colocated"]
    out = {name: await run_mode(name, modes[name], args) for name in order}
    d, c = out["disaggregated"], out["colocated"]
    return {
        "benchmark": "disagg_vs_colocated", "model": args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, fp32)",
        "machine": machine(),
        "workload": {"max_num_batched_tokens": args.max_num_batched_tokens,
                     "streams": args.streams, "stream_prompt": args.stream_prompt,
                     "stream_output": args.stream_output, "long_prompt": args.long_len,
                     "long_output": args.long_output, "long_rate_per_s": args.long_rate,
                     "duration_s": args.duration, "measure_window_s": [args.settle, args.duration]},
        "disaggregated": d, "colocated": c,
        "p99_itl_disagg_over_colocated": ratio(d, c, "stream_itl_ms", "p99"),
        "p50_itl_disagg_over_colocated": ratio(d, c, "stream_itl_ms", "p50"),
        "p99_long_ttft_disagg_over_colocated": ratio(d, c, "long_ttft_ms", "p99"),
        "target": "disaggregated p99 ITL <= 0.5x colocated",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF dir or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--streams", type=int, default=4, help="concurrent decode streams (closed loop)")
    p.add_argument("--stream-prompt", type=int, default=32)
    p.add_argument("--stream-output", type=int, default=64)
    p.add_argument("--long-len", type=int, default=512, help="tokens of each arriving long prompt")
    p.add_argument("--long-output", type=int, default=4)
    p.add_argument("--long-rate", type=float, default=0.25, help="long prompts per second (Poisson)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per mode")
    p.add_argument("--settle", type=float, default=3.0, help="seconds before long prompts and measuring start")
    p.add_argument("--kv-blocks", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="engine token budget per step in both modes: chunked prefill, the usual colocated "
                   "mitigation (default 256)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--colocated-first", action="store_true")
    args = p.parse_args()
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()

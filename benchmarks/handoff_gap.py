"""The hand-off gap: a request's first token comes from the prefill node, its second
from the decode node, and the gap between them is the longest of its inter-token
gaps. This measures it against the steady gaps under a given load, and breaks it
down from the frontend's own histograms (pdserve_handoff_seconds{stage}):

- join: the decode node's submit, from the first token to the request joining its
  batch; of which room (waiting for free KV blocks) and pull (the KV read);
- first_step: from joining to the second token reaching the frontend (the rest of
  the step in flight, the step that computes the token, the output stream);
- total: first to second token, at the frontend.

    .venv/bin/python benchmarks/handoff_gap.py [--rate 2 --requests 48 --input-len 256 --output-len 64]

Per mode, one local cluster (1 prefill + 1 decode worker, the bundled SmolLM2
unless --model), Poisson arrivals, every prompt handed off; the modes run one
after the other on the same arrivals: `reserve` (the decode blocks are reserved
while the prompt is prefilled, the default) and `no-reserve` (allocated after
the prefill). Prints one JSON line: per mode, client-side first gap and steady
gaps (p50 / p99), the ratio, and each stage's mean and share of the total.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from cluster.tools.bench import arrivals, datasets as ds  # noqa: E402
from cluster.tools.bench.runner import RunnerConfig, run_load  # noqa: E402
from cluster.config import ServeConfig  # noqa: E402
from cluster.server_stack import start_stack  # noqa: E402
from disagg_vs_colocated import free_port, machine  # noqa: E402

STAGES = ("join", "room", "pull", "first_step", "total")


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(1e3 * xs[min(len(xs) - 1, int(q * len(xs)))], 1)


def stage_sums(registry) -> dict[str, tuple[float, float]]:
    """(count, sum of seconds) per stage of pdserve_handoff_seconds so far."""
    return {st: (registry.get_sample_value("pdserve_handoff_seconds_count", {"stage": st}) or 0.0,
                 registry.get_sample_value("pdserve_handoff_seconds_sum", {"stage": st}) or 0.0)
            for st in STAGES}


def stage_means(before: dict, after: dict) -> dict[str, dict]:
    """Each stage's mean over the measured run (the warm-up taken out) and share of the total."""
    out = {}
    for st in STAGES:
        n, total_s = after[st][0] - before[st][0], after[st][1] - before[st][1]
        out[st] = {"count": int(n), "mean_ms": round(1e3 * total_s / n, 1) if n else None}
    total = out["total"]["mean_ms"]
    for st in STAGES[:-1]:
        m = out[st]["mean_ms"]
        out[st]["share_of_total"] = round(m / total, 3) if m is not None and total else None
    return out


async def run_mode(args, reserve: bool) -> dict:
    import ray

    cfg = ServeConfig(model=args.model, grpc_port=free_port(), metrics_port=0, http_port=0,
                      torch_threads=1,
                      reserve_decode_blocks=reserve, prefill_workers=1, decode_workers=1, max_num_seqs=args.max_num_seqs,
                      num_kv_blocks=args.kv_blocks, max_model_len=args.input_len + args.output_len + 64,
                      local_prefill_threshold=0, local_prefill_hit_ratio=1.0, log_level="WARNING",
                      ray_temp_dir=tempfile.mkdtemp(prefix="pdserve-bench-ray-"))
    stack = await start_stack(cfg)
    try:
        info = stack.backend.model_info()
        warm = ds.random_dataset(ds.RandomSpec(64, 4), 4, info.vocab_size, 12345)
        await run_load(stack.grpc.target, warm, [0.0] * len(warm), RunnerConfig(progress=False))
        before = stage_sums(stack.metrics.registry)
        reqs = ds.random_dataset(ds.RandomSpec(args.input_len, args.output_len), args.requests, info.vocab_size,
                                 args.seed)
        offsets = arrivals.schedule(arrivals.ArrivalSpec(args.rate), len(reqs), args.seed)
        run = await run_load(stack.grpc.target, reqs, offsets, RunnerConfig(progress=False, drain_timeout_s=300))
        after = stage_sums(stack.metrics.registry)
    finally:
        await stack.drain_and_stop(1.0)
        ray.shutdown()
    ok = [r for r in run.results if r.ok and len(r.token_times_s) >= 3]
    first = [r.token_times_s[1] - r.token_times_s[0] for r in ok]
    steady = [g for r in ok for g in (b - a for a, b in zip(r.token_times_s[1:], r.token_times_s[2:]))]
    stages = stage_means(before, after)
    assert stages["total"]["count"], "no hand-off was measured"
    return {"finished": len(ok), "first_gap_ms": {"p50": pct(first, 0.5), "p99": pct(first, 0.99)},
            "steady_gap_ms": {"p50": pct(steady, 0.5), "p99": pct(steady, 0.99)},
            "first_gap_p99_over_steady_p50": round(pct(first, 0.99) / pct(steady, 0.5), 2)
            if first and steady else None,
            "stages": stages}


async def main_async(args) -> dict:
    modes = {}
    for mode in args.modes.split(","):
        if mode not in ("reserve", "no-reserve"):
            raise ValueError(f"--modes takes reserve and/or no-reserve, got {mode!r}")
        modes[mode] = await run_mode(args, mode == "reserve")
    return {"benchmark": "handoff_gap", "machine": machine(),
            "workload": {"rate_per_s": args.rate, "requests": args.requests, "input_len": args.input_len,
                         "output_len": args.output_len, "max_num_seqs": args.max_num_seqs},
            "modes": modes, "goal": "first gap p99 under two steady gaps (p50)"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF dir or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-blocks", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="reserve,no-reserve", help="comma-separated: reserve, no-reserve")
    print(json.dumps(asyncio.run(main_async(p.parse_args()))))


if __name__ == "__main__":
    main()

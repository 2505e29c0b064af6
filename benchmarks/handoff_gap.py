"""The hand-off gap: a request's first token comes from the prefill node, its second
from the decode node, and the gap between them is the longest of its inter-token
gaps. This measures it against the steady gaps under a given load, and breaks it
down from the frontend's own histograms (pdserve_handoff_seconds{stage}):

- join: the decode node's submit, from the first token to its return; of which
  room (waiting for free KV blocks) and pull (the KV read);
- admit: from the first token to the decode node's report that the request is in
  its running batch (the step computing the second token has begun);
- hold: from the first token to its release to the client (first_token_release
  decode: until the admission; prefill: ~0);
- first_step: from the join to the second token reaching the frontend;
- client_gap: from the released first token to the second (what the client sees);
- total: first to second token, at the frontend.

    .venv/bin/python benchmarks/handoff_gap.py [--rate 2 --requests 48 --input-len 256 --output-len 64]
        [--modes prefill-release,decode-release --rounds 1]

Per mode and round, one local cluster (1 prefill + 1 decode worker, the bundled
SmolLM2 unless --model), Poisson arrivals, every prompt handed off, the same
arrivals in every mode; rounds alternate the modes' order and pool their requests.
Modes: `prefill-release` (the decode blocks reserved during the prefill, the first
token streamed as the prefill node samples it), `decode-release` (the same, the
first token held until the decode node admitted the request) and `no-reserve`
(blocks allocated after the prefill, token streamed at once). `--pin-decode` puts the decode worker on
a CPU of its own and everything else of the run (prefill worker, frontend, load
generator, Ray) on the others, as when the decode pool has its own machine: on a
shared 2-core host the prefill's compute otherwise lands in the decode steps' tail.
Prints one JSON
line: per mode, client-side TTFT, first gap and steady gaps (p50 / p99), the
ratio, and each stage's mean and share of the total.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from cluster.tools.bench import arrivals, datasets as ds  # noqa: E402
from cluster.tools.bench.runner import RunnerConfig, run_load  # noqa: E402
from cluster.config import ServeConfig  # noqa: E402
from cluster.server_stack import start_stack  # noqa: E402
from disagg_vs_colocated import free_port, machine  # noqa: E402
from process_cpu import descendants  # noqa: E402

STAGES = ("join", "room", "pull", "admit", "hold", "first_step", "client_gap", "total")
MODES = {   # mode -> (reserve_decode_blocks, first_token_release)
    "prefill-release": (True, "prefill"),
    "decode-release": (True, "decode"),
    "no-reserve": (False, "prefill"),
}


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


def stage_means(sums: list[tuple[dict, dict]]) -> dict[str, dict]:
    """Each stage's mean over the measured runs (warm-ups taken out) and share of the total."""
    out = {}
    for st in STAGES:
        n = sum(after[st][0] - before[st][0] for before, after in sums)
        total_s = sum(after[st][1] - before[st][1] for before, after in sums)
        out[st] = {"count": int(n), "mean_ms": round(1e3 * total_s / n, 1) if n else None}
    total = out["total"]["mean_ms"]
    for st in STAGES[:-1]:
        m = out[st]["mean_ms"]
        out[st]["share_of_total"] = round(m / total, 3) if m is not None and total else None
    return out


def pin_decode_worker() -> dict:
    """The decode worker's threads on the last CPU, every other thread of the run on the rest."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError("--pin-decode needs at least 2 CPUs in this process's affinity mask")
    decode, rest = {cpus[-1]}, set(cpus[:-1])
    pinned = {"decode_cpus": sorted(decode), "other_cpus": sorted(rest), "decode_pids": []}
    for pid in [os.getpid()] + descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                is_decode = f.read().startswith(b"ray::DecodeWorker")
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), decode if is_decode else rest)
        except (FileNotFoundError, ProcessLookupError):
            continue   # exited meanwhile
        if is_decode:
            pinned["decode_pids"].append(pid)
    if not pinned["decode_pids"]:
        raise RuntimeError("--pin-decode found no ray::DecodeWorker process below this one")
    return pinned


async def run_mode(args, mode: str) -> tuple[list, tuple[dict, dict]]:
    """One cluster, one load: the finished requests and the stage sums before / after."""
    import ray

    reserve, release = MODES[mode]
    cfg = ServeConfig(model=args.model, grpc_port=free_port(), metrics_port=0, http_port=0,
                      torch_threads=1, first_token_release=release,
                      reserve_decode_blocks=reserve, prefill_workers=1, decode_workers=1, max_num_seqs=args.max_num_seqs,
                      num_kv_blocks=args.kv_blocks, max_model_len=args.input_len + args.output_len + 64,
                      local_prefill_threshold=0, local_prefill_hit_ratio=1.0, log_level="WARNING",
                      ray_temp_dir=tempfile.mkdtemp(prefix="pdserve-bench-ray-"))
    stack = await start_stack(cfg)
    try:
        if args.pin_decode:
            print(json.dumps({"pinned": pin_decode_worker()}), file=sys.stderr)
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
    return [r for r in run.results if r.ok and len(r.token_times_s) >= 3], (before, after)


def summary(ok: list, sums: list[tuple[dict, dict]]) -> dict:
    first = [r.token_times_s[1] - r.token_times_s[0] for r in ok]
    steady = [g for r in ok for g in (b - a for a, b in zip(r.token_times_s[1:], r.token_times_s[2:]))]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    stages = stage_means(sums)
    assert stages["total"]["count"], "no hand-off was measured"
    return {"finished": len(ok), "ttft_ms": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99)},
            "first_gap_ms": {"p50": pct(first, 0.5), "p99": pct(first, 0.99)},
            "steady_gap_ms": {"p50": pct(steady, 0.5), "p99": pct(steady, 0.99)},
            "first_gap_p99_over_steady_p50": round(pct(first, 0.99) / pct(steady, 0.5), 2)
            if first and steady else None,
            "stages": stages}


async def main_async(args) -> dict:
    names = args.modes.split(",")
    unknown = [m for m in names if m not in MODES]
    if unknown or args.rounds < 1:
        raise ValueError(f"--modes takes {', '.join(MODES)} (comma-separated), got {unknown}; --rounds >= 1")
    runs: dict[str, tuple[list, list]] = {m: ([], []) for m in names}
    for r in range(args.rounds):   # alternate the order: neither mode always runs on a warmer host
        for mode in (names if r % 2 == 0 else names[::-1]):
            ok, sums = await run_mode(args, mode)
            runs[mode][0].extend(ok)
            runs[mode][1].append(sums)
    return {"benchmark": "handoff_gap", "machine": machine(),
            "workload": {"rate_per_s": args.rate, "requests": args.requests, "input_len": args.input_len,
                         "output_len": args.output_len, "max_num_seqs": args.max_num_seqs, "rounds": args.rounds,
                         "pin_decode": args.pin_decode},
            "modes": {m: summary(*runs[m]) for m in names}, "goal": "first gap p99 under two steady gaps (p50)"}


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
    p.add_argument("--modes", default="prefill-release,decode-release", help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument("--rounds", type=int, default=1, help="runs per mode, the order alternating; requests pooled")
    p.add_argument("--pin-decode", action="store_true",
                   help="the decode worker on a CPU of its own, the rest of the run on the others")
    print(json.dumps(asyncio.run(main_async(p.parse_args()))))


if __name__ == "__main__":
    main()

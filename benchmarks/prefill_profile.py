"""Prefill throughput of pdserve's engine, and where a prefill step's time goes.

One engine (SmolLM2 fp32 or --model) in this process; for each workload (``--rows``:
prompts x prompt tokens, default 32x512 and 48x128) it adds fresh seeded random prompts
with ``max_tokens=1`` and times ``LLMEngine.step()`` until they finish: prompt tok/s.
Variants (``--budget``: the scheduler's ``max_num_batched_tokens``; ``--kernel-prefill on off``:
cpu_paged's prefill steps in its kernel or in torch_paged) run on the same engine,
alternating, for ``--rounds`` rounds; each figure is the best round (the median is also
printed). Another engine tree is measured by running this script with its PYTHONPATH.

With ``--parts`` one more prefill per variant is cut into parts by timing the engine's
own calls (wrapped on the instance): ``gemm`` (every projection: ``FusedLinear.forward``),
``rmsnorm``, ``attention`` (the backend's per-layer calls) and ``attention_plan``,
``lm_head`` (``model.logits``: the sampled rows only), ``inputs`` (``build_inputs``),
``other_model`` (the rest of the forward: embedding, RoPE, SiLU*mul, residual adds, slicing),
``engine`` (the rest of ``step()``). Prints one JSON line.

  python benchmarks/prefill_profile.py --rows 8x512 16x128 --parts
  python benchmarks/prefill_profile.py --budget 2048 4096 --rows 32x512
  python benchmarks/prefill_profile.py --kernel-prefill on off --rows 32x512 48x128 --parts
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model.layers import FusedLinear, RMSNorm
from engine.sampling_params import SamplingParams
from step_profile import Timers  # benchmarks/ is the script's own directory


def run_prefill(engine: LLMEngine, rng: random.Random, n: int, length: int, tag: str) -> tuple[float, int]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = engine.vocab_size
    for i in range(n):
        engine.add_request(f"{tag}-{i}", [rng.randrange(100, vocab) for _ in range(length)], params)
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return time.perf_counter() - t0, steps


def set_variant(engine: LLMEngine, variant: tuple[int, str]) -> None:
    """(budget, kernel prefill): the step's token budget; "on"/"off" sets whether cpu_paged runs
    prefill steps in its kernel ("auto": the backend's own rule)."""
    budget, kernel = variant
    sched = engine.scheduler
    sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=budget)
    attention = engine.runner.attention
    if kernel != "auto":
        if not hasattr(attention, "prefill_in_kernel"):
            raise SystemExit(f"--kernel-prefill {kernel}: the engine's attention backend is {attention.name}, "
                             "not cpu_paged")
        attention.prefill_in_kernel = kernel == "on"


def variant_name(variant: tuple[int, str]) -> str:
    budget, kernel = variant
    return f"budget={budget}" + ("" if kernel == "auto" else f",kernel_prefill={kernel}")


def parts(engine: LLMEngine, rng: random.Random, n: int, length: int) -> dict:
    """One prefill of ``n x length`` with the engine's calls timed (wrappers removed after)."""
    timers = Timers()
    runner, model = engine.runner, engine.runner.model
    wrapped: list[Any] = [runner, model, runner.attention, engine]
    timers.wrap(runner, "build_inputs", "inputs")
    timers.wrap(runner, "run", "runner_run")
    timers.wrap(model, "logits", "lm_head")
    timers.wrap(runner.attention, "forward", "attention")
    timers.wrap(runner.attention, "plan", "attention_plan")
    for m in model.modules():
        if isinstance(m, FusedLinear):
            timers.wrap(m, "forward", "gemm")
            wrapped.append(m)
        elif isinstance(m, RMSNorm):
            timers.wrap(m, "forward", "rmsnorm")
            wrapped.append(m)
    dt, _ = run_prefill(engine, rng, n, length, "parts")
    for obj in wrapped:                      # drop the instance attributes: back to the class methods
        for name in ("build_inputs", "run", "logits", "forward", "plan"):
            obj.__dict__.pop(name, None)
    a = timers.acc
    model_s = a["runner_run"]
    known = ("gemm", "rmsnorm", "attention", "attention_plan", "lm_head")
    out = {k: a[k] for k in known}
    out["other_model"] = model_s - sum(out.values())
    out["inputs"] = a["inputs"]
    out["engine"] = dt - model_s - a["inputs"]
    return {"seconds": round(dt, 3), "s": {k: round(v, 3) for k, v in out.items()},
            "share": {k: round(v / dt, 4) for k, v in out.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", nargs="+", default=["32x512", "48x128"], help="PROMPTSxTOKENS workloads")
    ap.add_argument("--budget", type=int, nargs="+", default=[2048], help="max_num_batched_tokens variants")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kernel-prefill", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                    help="cpu_paged's prefill steps in its kernel (on) or torch_paged (off); each a variant")
    ap.add_argument("--parts", action="store_true", help="cut the first variant's prefill into parts")
    args = ap.parse_args()
    config = EngineConfig(model=args.model or "", dtype=args.dtype, seed=0,
                          cache=CacheConfig(kv_cache_memory_bytes=2 << 30),
                          scheduler=SchedulerConfig(max_num_seqs=64, max_model_len=2048))
    engine = LLMEngine(config)
    variants = [(b, k) for b in args.budget for k in args.kernel_prefill]
    rng = random.Random(0)
    run_prefill(engine, rng, 2, 64, "warm")
    workloads = [tuple(int(x) for x in r.split("x")) for r in args.rows]
    results: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rnd in range(args.rounds):
        for budget in (variants if rnd % 2 == 0 else variants[::-1]):
            set_variant(engine, budget)
            for n, length in workloads:
                dt, _ = run_prefill(engine, rng, n, length, f"r{rnd}")
                results[variant_name(budget)][f"{n}x{length}"].append(round(n * length / dt, 1))
    report: dict[str, Any] = {
        "benchmark": "prefill_profile", "dtype": args.dtype, "threads": torch.get_num_threads(),
        "isa": torch.backends.cpu.get_cpu_capability(), "rounds": args.rounds, "metric": "prompt tok/s",
        "variants": {v: {w: {"best": max(r), "median": round(statistics.median(r), 1), "rounds": r}
                         for w, r in rows.items()} for v, rows in results.items()}}
    if args.parts:
        report["parts"] = {}
        for budget in variants:
            set_variant(engine, budget)
            report["parts"][variant_name(budget)] = {
                f"{n}x{length}": parts(engine, rng, n, length) for n, length in workloads}
    print(json.dumps(report))


if __name__ == "__main__":
    main()

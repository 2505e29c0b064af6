"""Per-step decode time of the paged model on SmolLM2 (or any model path).

Prefills ``batch`` random prompts of ``ctx`` tokens, then times ``steps``
decode steps through ModelRunner.execute (metadata build included).
Prints one JSON line.  Usage:
  python benchmarks/decode_step.py --batch 1 16 --dtype float32 bfloat16 --ctx 128
  python benchmarks/decode_step.py --batch 16 --dtype float32 --kv-cache-dtype auto int8 fp8_e4m3
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import CacheConfig  # noqa: E402
from engine.loader import load_model_source  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler_output import ScheduledSeq, SchedulerOutput  # noqa: E402


def run(cfg, state, batch: int, ctx: int, steps: int, dtype: str, block_size: int,
        kv_cache_dtype: str = "auto") -> dict:
    blocks_per = -(-(ctx + steps + 1) // block_size)
    runner = ModelRunner(cfg, state, cache_config=CacheConfig(block_size=block_size,
                                                              num_blocks=batch * blocks_per + 1,
                                                              kv_cache_dtype=kv_cache_dtype),
                         max_model_len=blocks_per * block_size, dtype=dtype)
    rng = random.Random(0)
    ids = list(range(1, batch * blocks_per + 1))
    rng.shuffle(ids)
    reqs, tables = [], []
    for i in range(batch):
        r = Request(f"r{i}", [rng.randrange(100, cfg.vocab_size) for _ in range(ctx)],
                    SamplingParams(max_tokens=steps + 1, temperature=0.0))
        tables.append(ids[i * blocks_per:(i + 1) * blocks_per])
        reqs.append(r)
    t0 = time.perf_counter()
    for r, t in zip(reqs, tables):          # prefill one by one
        logits = runner.execute(SchedulerOutput([ScheduledSeq(r, ctx, t, True)]))
        r.num_computed_tokens = ctx
        r.append_output_token(int(logits[0].argmax()))
    prefill_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        sched = SchedulerOutput([ScheduledSeq(r, 1, t, True) for r, t in zip(reqs, tables)])
        t0 = time.perf_counter()
        logits = runner.execute(sched)
        times.append(time.perf_counter() - t0)
        nxt = logits.argmax(-1).tolist()
        for r, tok in zip(reqs, nxt):
            r.num_computed_tokens += 1
            r.append_output_token(tok)
    times.sort()
    med = times[len(times) // 2]
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return {"batch": batch, "ctx": ctx, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "step_ms_median": round(med * 1e3, 2),
            "step_ms_min": round(times[0] * 1e3, 2), "tok_per_s": round(batch / med, 1),
            "prefill_tok_per_s": round(batch * ctx / prefill_s, 1),
            "weight_MB": round(weight_bytes / 1e6, 1),
            "weight_read_GBps": round(weight_bytes / med / 1e9, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=("auto", "int8", "fp8_e4m3"))
    args = ap.parse_args()
    cfg, state = load_model_source(args.model)
    results = [run(cfg, state, b, args.ctx, args.steps, d, args.block_size, kv)
               for d in args.dtype for kv in args.kv_cache_dtype for b in args.batch]
    print(json.dumps({"benchmark": "decode_step", "model": cfg.name,
                      "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()

"""Per-step decode time of the paged model on SmolLM2 (or any model path).

Prefills ``batch`` random prompts of ``ctx`` tokens, then times ``steps``
decode steps through ModelRunner.execute (metadata build included).
Prints one JSON line.  Usage:
  python benchmarks/decode_step.py --batch 1 16 --dtype float32 bfloat16 --ctx 128
  python benchmarks/decode_step.py --batch 16 --dtype float32 --kv-cache-dtype auto int8 fp8_e4m3 --interleave
  python benchmarks/decode_step.py ... --threads 1     # steadier on a shared host
  python benchmarks/decode_step.py --batch 1 32 --ctx 512 --attention-backend torch_paged cpu_paged --interleave
  python benchmarks/decode_step.py --batch 48 --ctx 192 --dtype float32 --qkv-path torch fused --interleave
  python benchmarks/decode_step.py --batch 32 --ctx 512 --dtype float32 --threads 2 --omp-threads-bind auto
``--qkv-path torch`` runs the backend's generic ``forward_qkv`` (RoPE in torch, then
``forward``: the K/V write by ``index_put_``) instead of its own (cpu_paged: one fused op).
"""
from __future__ import annotations

import argparse
import json
import random
import time
import types

import torch

from engine.attention.backend import AttentionBackend
from engine.config import CacheConfig
from engine.loader import load_model_source
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.thread_pinning import ThreadPinner


class Case:
    """One (dtype, kv_cache_dtype) runner with ``batch`` prompts of ``ctx`` tokens prefilled."""

    def __init__(self, cfg, state, batch: int, ctx: int, steps: int, dtype: str, block_size: int,
                 kv_cache_dtype: str = "auto", attention_backend: str = "auto", qkv_path: str = "fused") -> None:
        blocks_per = -(-(ctx + steps + 1) // block_size)
        self.runner = ModelRunner(cfg, state, cache_config=CacheConfig(block_size=block_size,
                                                                       num_blocks=batch * blocks_per + 1,
                                                                       kv_cache_dtype=kv_cache_dtype),
                                  max_model_len=blocks_per * block_size, dtype=dtype,
                                  attention_backend=attention_backend)
        self.key = dict(batch=batch, ctx=ctx, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                        attention_backend=self.runner.attention.name, qkv_path=qkv_path)
        if qkv_path == "torch":      # the base class's path: RoPE in torch, then forward()
            attention = self.runner.attention
            attention.forward_qkv = types.MethodType(AttentionBackend.forward_qkv, attention)  # type: ignore[method-assign]
        rng = random.Random(0)
        ids = list(range(1, batch * blocks_per + 1))
        rng.shuffle(ids)
        self.reqs, self.tables = [], []
        for i in range(batch):
            self.reqs.append(Request(f"r{i}", [rng.randrange(100, cfg.vocab_size) for _ in range(ctx)],
                                     SamplingParams(max_tokens=steps + 1, temperature=0.0)))
            self.tables.append(ids[i * blocks_per:(i + 1) * blocks_per])
        t0 = time.perf_counter()
        for r, t in zip(self.reqs, self.tables):          # prefill one by one
            logits = self.runner.execute(SchedulerOutput([ScheduledSeq(r, ctx, t, True)]))
            r.num_computed_tokens = ctx
            r.append_output_token(int(logits[0].argmax()))
        self.prefill_s = time.perf_counter() - t0
        self.times: list[float] = []
        self.cpu: list[float] = []

    def step(self) -> None:
        sched = SchedulerOutput([ScheduledSeq(r, 1, t, True) for r, t in zip(self.reqs, self.tables)])
        t0, c0 = time.perf_counter(), time.process_time()
        logits = self.runner.execute(sched)
        self.times.append(time.perf_counter() - t0)
        self.cpu.append(time.process_time() - c0)
        for r, tok in zip(self.reqs, logits.argmax(-1).tolist()):
            r.num_computed_tokens += 1
            r.append_output_token(tok)

    def result(self) -> dict:
        times, cpu = sorted(self.times), sorted(self.cpu)
        med = times[len(times) // 2]
        batch, ctx = self.key["batch"], self.key["ctx"]
        weight_bytes = read_weight_bytes(self.runner.model)
        return {**self.key, "step_ms_median": round(med * 1e3, 2),
                "step_ms_min": round(times[0] * 1e3, 2), "step_cpu_ms_median": round(cpu[len(cpu) // 2] * 1e3, 2),
                "tok_per_s": round(batch / med, 1), "prefill_tok_per_s": round(batch * ctx / self.prefill_s, 1),
                "weight_MB": round(weight_bytes / 1e6, 1),
                "weight_read_GBps": round(weight_bytes / med / 1e9, 2)}


def read_weight_bytes(model) -> int:
    """Weight bytes a decode step reads: the projections and LM head (packed or plain) and the
    norms; the embedding only when it is also the (unpacked) LM head."""
    def size(t) -> int:
        return t.numel() * t.element_size()
    total = sum(size(p) for name, p in model.named_parameters() if name != "embed_tokens")
    total += sum(size(m.packed) for m in model.modules() if getattr(m, "packed", None) is not None)
    head = model.lm_head_packed if model.lm_head_packed is not None else model.lm_head_weight
    return total + (size(head) if model.lm_head is None or model.lm_head_packed is not None else 0)


def run(cfg, state, batch: int, ctx: int, steps: int, dtype: str, block_size: int,
        kv_cache_dtype: str = "auto", attention_backend: str = "auto", qkv_path: str = "fused") -> dict:
    case = Case(cfg, state, batch, ctx, steps, dtype, block_size, kv_cache_dtype, attention_backend, qkv_path)
    for _ in range(steps):
        case.step()
    return case.result()


def run_interleaved(cases: list[Case], steps: int) -> list[dict]:
    """Step every case in turn, ``steps`` rounds: a busy shared host slows them alike."""
    for _ in range(steps):
        for case in cases:
            case.step()
    return [c.result() for c in cases]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=("auto", "int8", "fp8_e4m3"))
    ap.add_argument("--attention-backend", nargs="+", default=["auto"],
                    help="auto, or names from engine.attention.available_backends() (side by side)")
    ap.add_argument("--qkv-path", nargs="+", default=["fused"], choices=("fused", "torch"),
                    help="fused: the backend's forward_qkv (cpu_paged: RoPE + K/V write in one op); "
                         "torch: the generic one (RoPE in torch, index_put_ writes), side by side")
    ap.add_argument("--interleave", action="store_true",
                    help="prefill every case first, then time their decode steps in turn (side by side)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's); 1 keeps timings steady on a shared host")
    ap.add_argument("--omp-threads-bind", default="off",
                    help="off, auto or a core list: pin this thread's OpenMP team (engine/thread_pinning.py)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pinner = ThreadPinner(args.omp_threads_bind)
    pinner.ensure()
    cfg, state = load_model_source(args.model)
    grid = [(b, d, kv, ab, qp) for d in args.dtype for kv in args.kv_cache_dtype for b in args.batch
            for ab in args.attention_backend for qp in args.qkv_path]
    if args.interleave:
        cases = [Case(cfg, state, b, args.ctx, args.steps, d, args.block_size, kv, ab, qp) for b, d, kv, ab, qp in grid]
        results = run_interleaved(cases, args.steps)
        if len(cases) > 1:
            results.append({"same_tokens_across_cases": all(
                [r.output_token_ids for r in c.reqs] == [r.output_token_ids for r in cases[0].reqs]
                for c in cases if {**c.key, "qkv_path": ""} == {**cases[0].key, "qkv_path": ""})})
    else:
        results = [run(cfg, state, b, args.ctx, args.steps, d, args.block_size, kv, ab, qp) for b, d, kv, ab, qp in grid]
    print(json.dumps({"benchmark": "decode_step", "model": cfg.name,
                      "threads": torch.get_num_threads(), "omp_threads_bind": args.omp_threads_bind,
                      "pinned": pinner.pinned, "results": results}))


if __name__ == "__main__":
    main()

"""Where an engine decode step's time goes, at batch 1 and batch 32 (or --batch ...).

Runs `LLMEngine.step()` on SmolLM2 (or --model) with `batch` requests of `--ctx` prompt
tokens, greedy, ignore_eos, and after the prefill times `--steps` pure decode steps. Each
step is cut into parts by timing the engine's own calls (wrapped on the instance, nothing
changed in the engine):

- ``forward``: the model's forward (``model.forward``) less attention and the linear layers:
  norms, activations, residual adds and the Python between them;
- ``linear``: the linear layers (every ``FusedLinear`` and the LM head: oneDNN-packed weights,
  or their 16-output panels for steps of <= 8 rows);
- ``attention``: the attention backend's per-layer ``forward_qkv`` calls (RoPE + K/V write +
  attend);
- ``attention_plan``: the backend's per-step ``plan`` (index tensors shared by all layers);
- ``sampling``: ``Sampler.sample``;
- ``scheduling``: ``Scheduler.schedule``;
- ``inputs``: ``ModelRunner.build_inputs`` (the flat batch tensors);
- ``output``: the rest of ``step()``: scheduler update, stop checks, detokenisation, deltas,
  KV moves, logits cast.

With the layers in one C++ call (engine/model/layer_stack.py: the default for float32 weights packed
on CPU with the cpu_paged kernel) the per-layer parts are inside it: ``forward`` is then the whole stack (its
linear layers and attention included) and ``linear`` the LM head only. ``--layer-stack on off``
profiles both ways (``off``: the model's Python loop over the layers, which the parts above cut up).

Each row also has ``step_ms_unwrapped_median``: ``--steps`` steps timed before any call is wrapped
(the wrappers' own Python adds to the parts' totals, most in the loop's ~300 wrapped calls a step).
``--op-table N`` adds ``ops_self_ms_per_step``: torch.profiler over ``--steps`` more unwrapped
steps, the N ops with the most self CPU time and all ops together, in ms a step.

``--plain-weights`` runs the linear layers on plain weights (``F.linear``, MKL) instead of
oneDNN-packed ones (the default, engine/model/packed_linear.py). Shares are of the median step; the goal (issue 26)
is everything but forward+attention under 10% at batch 1 and under 5% at batch 32.
Prints one JSON line.

  python benchmarks/step_profile.py                      # batch 1 and 32, fp32, eager
  python benchmarks/step_profile.py --plain-weights      # linear layers on plain weights
  python benchmarks/step_profile.py --batch 1 4 --layer-stack on off   # the layer stack against the loop
  python benchmarks/step_profile.py --batch 1 --layer-stack off --op-table 8   # the ops a step spends its time in
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model.layers import FusedLinear
from engine.sampling_params import SamplingParams

PARTS = ("forward", "linear", "attention", "attention_plan", "sampling", "scheduling", "inputs", "output")


class Timers:
    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, obj: Any, method: str, key: str) -> None:
        fn: Callable = getattr(obj, method)
        acc = self.acc

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[key] += time.perf_counter() - t0
        setattr(obj, method, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.acc)
        self.acc.clear()
        return out


def build_engine(args, batch: int) -> LLMEngine:
    config = EngineConfig(
        model=args.model or "", dtype=args.dtype, seed=0,
        cache=CacheConfig(kv_cache_memory_bytes=args.kv_gib << 30, kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=max(2048, batch * args.ctx),
                                  max_model_len=args.max_model_len),
        packed_weights=not args.plain_weights, attention_backend=args.attention_backend)
    return LLMEngine(config)


def profile(args, batch: int, layer_stack: str = "on") -> dict:
    engine = build_engine(args, batch)
    stacked = engine.runner.model.layer_stack is not None and layer_stack == "on"
    if not stacked:
        engine.runner.model.layer_stack = None
    rng = random.Random(0)
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=3 * args.steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{i}", [rng.randrange(100, vocab) for _ in range(args.ctx)], params)
    t_prefill = time.perf_counter()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.num_waiting:
        engine.step()                                   # prefill (timed apart)
    t_prefill = time.perf_counter() - t_prefill
    for _ in range(3):
        engine.step()                                   # warm-up decode steps
    plain = []
    for _ in range(args.steps):                         # as served: no wrapper around any call
        t0 = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - t0)
    ops = op_table(engine, args.steps, args.op_table) if args.op_table else None
    timers = Timers()
    runner = engine.runner
    timers.wrap(engine.scheduler, "schedule", "scheduling")
    timers.wrap(runner, "build_inputs", "inputs")
    timers.wrap(runner.model, "forward", "model")
    timers.wrap(runner.attention, "plan", "attention_plan")
    timers.wrap(runner.attention, "forward_qkv", "attention")    # what the model calls (it may call forward)
    for module in runner.model.modules():
        if isinstance(module, FusedLinear):
            timers.wrap(module, "forward", "linear")
    timers.wrap(runner.model, "logits", "linear")
    timers.wrap(engine.sampler, "sample", "sampling")
    steps: list[dict[str, float]] = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
        acc = timers.take()
        model = acc.get("model", 0.0)
        attn = acc.get("attention")
        plan = acc.get("attention_plan", 0.0)
        linear = acc.get("linear", 0.0)
        part = {"total": total, "forward": model - (attn or 0.0) - plan - linear, "linear": linear, "attention": attn,
                "attention_plan": plan, "sampling": acc.get("sampling", 0.0),
                "scheduling": acc.get("scheduling", 0.0), "inputs": acc.get("inputs", 0.0)}
        part["output"] = total - sum(v or 0.0 for k, v in part.items() if k != "total")
        steps.append(part)
    med = sorted(steps, key=lambda s: s["total"])[len(steps) // 2]
    mean = {k: statistics.fmean(s[k] for s in steps) if steps[0][k] is not None else None
            for k in ("total",) + PARTS}
    tot = mean["total"]
    share = {k: (round(v / tot, 4) if v is not None else None) for k, v in mean.items() if k != "total"}
    non_forward = 1.0 - (share["forward"] or 0.0) - share["linear"] - (share["attention"] or 0.0)
    return {"batch": batch, "ctx": args.ctx, "layer_stack": stacked, "prefill_tok_per_s": round(batch * args.ctx / t_prefill, 1),
            "step_ms_unwrapped_median": round(statistics.median(plain) * 1e3, 2),
            "step_ms_median": round(med["total"] * 1e3, 2),
            "step_ms_mean": round(tot * 1e3, 2), "tok_per_s": round(batch / med["total"], 1),
            "ms_mean": {k: (round(v * 1e3, 3) if v is not None else None) for k, v in mean.items() if k != "total"},
            "share": share, "non_forward_share": round(non_forward, 4),
            "goal": 0.10 if batch == 1 else 0.05, "goal_met": non_forward < (0.10 if batch == 1 else 0.05),
            **({"ops_self_ms_per_step": ops} if ops is not None else {})}


def op_table(engine: LLMEngine, steps: int, top: int) -> dict[str, float]:
    """torch.profiler over ``steps`` unwrapped steps: the ``top`` ops by self CPU time, ms a step
    (a C++ op's own callees that skip the dispatcher count as its self time), and ``all_ops``."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    table = {e.key: round(e.self_cpu_time_total / 1e3 / steps, 3) for e in rows[:top]}
    table["all_ops"] = round(sum(e.self_cpu_time_total for e in rows) / 1e3 / steps, 3)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--kv-gib", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--attention-backend", default="auto", help="auto, torch_paged or cpu_paged")
    ap.add_argument("--plain-weights", action="store_true", help="F.linear on plain weights (packed_weights=False)")
    ap.add_argument("--layer-stack", nargs="+", default=["on"], choices=("on", "off"),
                    help="the layers through the C++ layer stack (on, where the model has one) or "
                         "the model's Python loop (off); both: each batch profiled both ways")
    ap.add_argument("--op-table", type=int, default=0, metavar="N",
                    help="also run torch.profiler over --steps unwrapped steps and report the N ops with the most "
                         "self CPU time (ms a step) and all ops together")
    args = ap.parse_args()
    rows = [profile(args, b, mode) for b in args.batch for mode in args.layer_stack]
    print(json.dumps({"benchmark": "step_profile", "dtype": args.dtype, "packed_weights": not args.plain_weights,
                      "attention_backend": args.attention_backend,
                      "threads": torch.get_num_threads(), "isa": torch.backends.cpu.get_cpu_capability(),
                      "rows": rows}))


if __name__ == "__main__":
    main()

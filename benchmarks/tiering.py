"""Multi-turn chat whose sessions go idle between turns, with and without the
host KV tier: TTFT of returning turns and how many idle sessions stay warm.

``n`` sessions each own a history (a system prompt + earlier turns). Turns go
round robin, one at a time: a session's next turn re-sends its history plus a
few new tokens, after every other session had a turn (it sat idle). The
device pool holds only a few sessions' histories; without a lower tier the
others' are evicted and recomputed, with the host tier they are paged back.
For each session count and setting: TTFT (p50 / mean) of returning turns,
the share of their cacheable history found cached, page-ins, bytes and seconds spent
moving blocks (executed as one batched gather + scatter per run of moves
before the step's forward), and greedy outputs compared across settings.
"Sustained sessions" is the largest count whose returning turns still hit
>= 90% of their cacheable history (its full blocks). A burst (every session's next turn at once) adds
swap vs recompute preemptions. Prints ONE JSON line.

  .venv/bin/python benchmarks/tiering.py                      # SmolLM2-135M, a few minutes on 2 CPUs
  .venv/bin/python benchmarks/tiering.py --model tiny --sessions 4 8 16
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model_source
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams


def _model(name: str) -> str:
    if name != "tiny":
        return name
    from cluster.tools.tiny_models import make_tiny_model
    return str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "llama"))


def _engine(args, host_blocks: int) -> LLMEngine:
    """A fresh engine on the weights loaded once (args.weights)."""
    # --device-kv-memory fixes the pool's bytes (its block count then follows from kv_cache_dtype)
    kv_bytes = getattr(args, "device_kv_memory", 0)
    cache = CacheConfig(block_size=16, num_blocks=None if kv_bytes else args.device_blocks,
                        kv_cache_memory_bytes=kv_bytes or 1 << 30, num_host_blocks=host_blocks,
                        preemption_mode=args.preemption_mode,
                        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    dtype = getattr(args, "dtype", "float32")
    config = EngineConfig(model=args.model, dtype=dtype, cache=cache, scheduler=SchedulerConfig(
        max_model_len=args.max_model_len, max_num_seqs=64, max_num_batched_tokens=4096))
    model_config, state = args.weights
    runner = ModelRunner(model_config, state, cache_config=cache, max_model_len=args.max_model_len, dtype=dtype)
    return LLMEngine(config, runner=runner)


def _run_turns(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams):
    """Add every prompt at once; step to the end. Returns (wall ttft s, cpu ttft s,
    output) per id; CPU seconds of this process are far less noisy on a shared machine."""
    start, cpu_start = time.perf_counter(), time.process_time()
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    first: dict[str, tuple[float, float]] = {}
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for d in engine.step():
            first.setdefault(d.request_id, (time.perf_counter() - start, time.process_time() - cpu_start))
            out[d.request_id].extend(d.new_token_ids)
    return {rid: (*first[rid], out[rid]) for rid in prompts}


def run(args, n: int, host_blocks: int) -> dict:
    engine = _engine(args, host_blocks)
    vocab = engine.runner.vocab_size
    rng = random.Random(n)
    history = [[rng.randrange(100, vocab - 1) for _ in range(args.history)] for _ in range(n)]
    params = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
    ttfts, cpu_ttfts, outputs, ideal, hit, computed = [], [], [], 0, 0, 0
    for turn in range(args.turns):
        for s in range(n):          # one session at a time; the others sit idle
            prompt = history[s] + [rng.randrange(100, vocab - 1) for _ in range(args.user)]
            before = engine.stats()
            [(ttft, cpu_ttft, out)] = _run_turns(engine, {f"s{s}t{turn}": prompt}, params).values()
            after = engine.stats()
            outputs.append(out)
            history[s] = prompt + out
            if turn:                # returning turn: its history's full blocks could all hit
                ttfts.append(ttft)
                cpu_ttfts.append(cpu_ttft)
                ideal += (len(prompt) - args.user - 1) // 16 * 16
                hit += after.prefix_hit_tokens - before.prefix_hit_tokens
                computed += len(prompt) - (after.prefix_hit_tokens - before.prefix_hit_tokens)
    steady = engine.stats()
    if getattr(args, "no_burst", False):    # kv_quant_capacity.py: only the warm-session measure
        return {"returning_history_hit": round(hit / max(1, ideal), 3), "page_ins": steady.kv_page_ins}
    burst = _run_turns(engine, {f"s{s}burst": history[s] + [rng.randrange(100, vocab - 1)
                                                            for _ in range(args.user)] for s in range(n)}, params)
    engine.check_integrity()
    stats, moves = engine.stats(), engine.runner.tiers.stats
    return {"ttft_returning_ms_p50": round(1e3 * statistics.median(ttfts), 2),
            "ttft_returning_ms_mean": round(1e3 * statistics.fmean(ttfts), 2),
            "ttft_returning_cpu_ms_p50": round(1e3 * statistics.median(cpu_ttfts), 2),
            "returning_history_hit": round(hit / max(1, ideal), 3),
            "returning_prefill_tokens_mean": round(computed / len(ttfts), 1),
            "page_ins": steady.kv_page_ins, "page_outs": steady.kv_page_outs,
            "tier_bytes_moved": moves.bytes_moved, "tier_move_seconds": round(moves.seconds, 4),
            "tier_move_gbps": round(moves.bytes_moved / moves.seconds / 1e9, 2) if moves.seconds else None,
            "burst_ttft_ms_mean": round(1e3 * statistics.fmean(t for t, _, _ in burst.values()), 2),
            "burst_swap_preemptions": stats.swap_preemptions - steady.swap_preemptions,
            "burst_recompute_preemptions": stats.recompute_preemptions - steady.recompute_preemptions,
            "_outputs": outputs + [o for _, _, o in burst.values()]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help='HF dir, .gguf, "" = SmolLM2-135M, "tiny" = a random tiny Llama')
    p.add_argument("--sessions", type=int, nargs="+", default=[4, 8, 12])
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--history", type=int, default=128, help="tokens of history each session starts with")
    p.add_argument("--user", type=int, default=16, help="new tokens per turn")
    p.add_argument("--reply", type=int, default=4, help="generated tokens per turn")
    p.add_argument("--device-blocks", type=int, default=48, help="device pool (blocks of 16 tokens)")
    p.add_argument("--host-blocks", type=int, default=256, help="host tier when on (blocks)")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--preemption-mode", default="auto")
    p.add_argument("--dtype", default="float32", help="model dtype (what --kv-cache-dtype auto stores)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8_e4m3"))
    p.add_argument("--device-kv-memory", type=int, default=0,
                   help="device pool in bytes (> 0 overrides --device-blocks: same bytes, any kv dtype)")
    args = p.parse_args()
    args.model = _model(args.model)
    args.weights = load_model_source(args.model or None)
    result: dict = {"benchmark": "tiering", "model": Path(args.model).name or "SmolLM2-135M",
                    "device_blocks": args.device_blocks, "host_blocks": args.host_blocks,
                    "history_tokens": args.history, "turns": args.turns, "by_sessions": {}}
    sustained = {"device_only": 0, "with_host": 0}
    t0 = time.perf_counter()
    for n in args.sessions:
        off = run(args, n, 0)
        print(f"n={n} device only: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        on = run(args, n, args.host_blocks)
        print(f"n={n} with host: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        same = off.pop("_outputs") == on.pop("_outputs")
        result["by_sessions"][str(n)] = {"device_only": off, "with_host": on, "outputs_identical": same}
        for key, r in (("device_only", off), ("with_host", on)):
            if r["returning_history_hit"] >= 0.9:
                sustained[key] = max(sustained[key], n)
    result["sustained_warm_sessions"] = sustained
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

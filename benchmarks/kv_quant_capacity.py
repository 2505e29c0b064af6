"""Sessions held warm at a fixed KV pool size, per KV storage dtype.

The tiering benchmark's measure (benchmarks/tiering.py): multi-turn sessions
go idle between turns; "sustained" is the largest session count whose
returning turns still find >= 90% of their cacheable history cached. Here the
device pool has the same *bytes* for every setting (``--device-kv-memory``),
so a setting's block count follows from its bytes per block (int8 / fp8_e4m3
blocks include their scales), and the largest sustained count is found by
bisection (no burst phase: only the warm-session measure). No host tier.
Prints ONE JSON line with the ratios against the bf16 and fp32 pools. Session
counts are integers: a larger pool makes their ratio less coarse.

  .venv/bin/python benchmarks/kv_quant_capacity.py                 # SmolLM2-135M, a few minutes
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from engine.loader import load_model_source

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = (("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"), ("float32", "fp8_e4m3"))


def _tiering():
    spec = importlib.util.spec_from_file_location("tiering", ROOT / "benchmarks" / "tiering.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tiering"] = mod
    spec.loader.exec_module(mod)
    return mod


def _tiny_hd64() -> str:
    """A random tiny Llama with SmolLM2's head_dim (64): the same bytes-per-block ratios, fast."""
    import tempfile
    from cluster.tools.tiny_models import make_tiny_model
    return str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny-hd64", "llama", hidden_size=256, num_heads=4,
                               num_kv_heads=2, intermediate_size=512))


def sustained(tiering, args, hi: int, lo: int = 0) -> tuple[int, dict]:
    """Largest n in [lo, hi] whose returning turns hit >= 90% (hit ratio falls as n grows)."""
    hits: dict[int, float] = {}

    def ok(n: int) -> bool:
        hits[n] = tiering.run(args, n, 0)["returning_history_hit"]
        return hits[n] >= 0.9

    if lo and not ok(lo):          # the guess was too high: search below it
        lo, hi = 0, lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo, dict(sorted(hits.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help='HF dir, .gguf; "" = SmolLM2-135M, "tiny" = the random tiny Llama (head_dim 16), '
                        '"tiny-hd64" = a random tiny Llama with head_dim 64')
    p.add_argument("--device-kv-memory", type=int, default=96 * 368640,
                   help="device pool bytes for every setting (default: 96 bf16 SmolLM2 blocks, 35.4 MB)")
    p.add_argument("--max-sessions", type=int, default=256)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--history", type=int, default=128)
    p.add_argument("--user", type=int, default=16)
    p.add_argument("--reply", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=256)
    args = p.parse_args()
    tiering = _tiering()
    args.model = _tiny_hd64() if args.model == "tiny-hd64" else tiering._model(args.model)
    args.weights = load_model_source(args.model or None)
    args.preemption_mode, args.device_blocks, args.no_burst = "auto", 0, True
    out: dict = {}
    t0 = time.perf_counter()
    for dtype, kv in SETTINGS:
        args.dtype, args.kv_cache_dtype = dtype, kv
        engine = tiering._engine(args, 0)
        blocks, per_block = engine.runner.num_blocks, engine.runner.kv_pool.bytes_per_block
        del engine
        # sessions hold about history + turns x (user + reply) tokens: search around what fits
        per_session = -(-(args.history + args.turns * (args.user + args.reply)) // 16)
        guess = blocks // per_session
        n, hits = sustained(tiering, args, min(args.max_sessions, guess * 3 // 2 + 2), guess * 4 // 5)
        name = kv if kv != "auto" else dtype
        out[name] = {"blocks": blocks, "bytes_per_block": per_block, "sustained_warm_sessions": n,
                     "hit_by_sessions": hits}
        print(f"{name}: {n} sessions ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    ratios = {f"{q}_vs_{base}": round(out[q]["sustained_warm_sessions"] / out[base]["sustained_warm_sessions"], 2)
              for q in ("int8", "fp8_e4m3") for base in ("bfloat16", "float32")}
    print(json.dumps({"benchmark": "kv_quant_capacity", "model": Path(args.model).name or "SmolLM2-135M",
                      "device_kv_memory": args.device_kv_memory, "history_tokens": args.history,
                      "turns": args.turns, "settings": out, "ratios": ratios,
                      "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()

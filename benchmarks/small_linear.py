"""Linear layers for a few rows: the panel kernel vs oneDNN-packed weights vs MKL, side by side.

A batch-1 decode step reads every weight once; its speed is how fast the weights stream.
This runs SmolLM2-135M's 30 layers' projections (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536, random fp32 weights) plus its 49152 x 576 LM head, for M = 1, 2, 4, 8 rows,
in each of three ways, alternating per round (the host's speed drifts):

- ``panel``: ``torch.ops.pdserve.panel_linear`` on 16-output panels, on huge pages as the engine
  keeps them (engine/model/panel_weights.py);
- ``onednn``: oneDNN's linear on its packed weights (engine/model/packed_linear.py, the default
  for more rows);
- ``mkl``: ``F.linear`` on plain weights.

Each figure is the best of --rounds; also a plain memory read of the same bytes (``torch.sum``) as
the stream rate to compare with. Prints one JSON line: ms and GB/s per way and M, and the
largest difference of the panel kernel's output from ``F.linear``'s.

    python benchmarks/small_linear.py [--rows 1 2 4 8] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from engine.attention.kernels import load_cpu_kernel
from engine.model.packed_linear import pack_weight, packed_linear
from engine.model.panel_weights import panel_linear, panels_on_huge_pages

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
LM_HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    why = load_cpu_kernel()
    if why is not None:
        print(json.dumps({"benchmark": "small_linear", "skipped": f"kernel did not build: {why}"}))
        return
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    weights = [torch.randn(*s) / 24 for _ in range(LAYERS) for s in SHAPES.values()] + [torch.randn(*LM_HEAD) / 24]
    onednn = [pack_weight(w) for w in weights]
    panels = panels_on_huge_pages(weights)      # as the engine keeps them
    nbytes = sum(w.numel() * 4 for w in weights)
    big = torch.randn(nbytes // 4)
    ways = {
        "panel": lambda xs: [panel_linear(x, p, None, w.shape[0]) for x, p, w in zip(xs, panels, weights)],
        "onednn": lambda xs: [packed_linear(x, p, None) for x, p in zip(xs, onednn)],
        "mkl": lambda xs: [F.linear(x, w) for x, w in zip(xs, weights)],
    }
    out: dict = {"benchmark": "small_linear", "threads": args.threads, "weight_mb": round(nbytes / 1e6, 1),
                 "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rows": {}}
    stream = float("inf")
    with torch.inference_mode():
        for m in args.rows:
            xs = [torch.randn(m, w.shape[1]) for w in weights]
            diff = max(float((a - b).abs().max()) for a, b in zip(ways["panel"](xs), ways["mkl"](xs)))
            best = {k: float("inf") for k in ways}
            for _ in range(args.rounds):
                for name, fn in ways.items():
                    t0 = time.perf_counter()
                    fn(xs)
                    best[name] = min(best[name], time.perf_counter() - t0)
                t0 = time.perf_counter()
                big.sum()
                stream = min(stream, time.perf_counter() - t0)
            out["rows"][m] = {**{k: {"ms": round(v * 1e3, 2), "gb_s": round(nbytes / v / 1e9, 1)} for k, v in best.items()},
                              "panel_vs_onednn": round(best["onednn"] / best["panel"], 3),
                              "max_abs_diff_vs_mkl": diff}
    out["stream_read_gb_s"] = round(nbytes / stream / 1e9, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

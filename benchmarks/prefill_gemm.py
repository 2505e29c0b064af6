"""fp32 GEMM speed of one SmolLM2 layer's projections against the number of rows (tokens).

For each row count M (``--rows``) it times the layer's four projections (qkv 576->960,
o 576->576, gate_up 576->3072, down 1536->576) as ``F.linear`` on the plain weight (MKL),
``torch.mm`` on a pre-transposed weight, and oneDNN's ``_linear_pointwise`` on a weight
packed with batch hint 32 (engine/model/packed_linear.py), 256 and M. Each figure is the
best of ``--repeats`` timings (this host is shared), as ms for the four and GFLOP/s.
Prints one JSON line. It answers whether a long prefill's 2048-row GEMMs on weights packed
for 32 rows are slower than smaller slices would be (docs/benchmarks.md: they are not).

  python benchmarks/prefill_gemm.py --rows 1 32 256 512 2048
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch
import torch.nn.functional as F

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))     # (out, in)


def best_ms(fn: Callable[[], torch.Tensor], repeats: int, inner: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best * 1e3


def candidates(x: torch.Tensor, w: torch.Tensor, hints: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    wt = w.t().contiguous()
    out: dict[str, Callable[[], torch.Tensor]] = {"F.linear": lambda: F.linear(x, w), "mm_t": lambda: torch.mm(x, wt)}
    for hint in hints:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, hint)
        out[f"packed_hint{hint}"] = (lambda p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256, 512, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = {}
    with torch.inference_mode():
        for m in args.rows:
            total: dict[str, float] = {}
            for o, i in SHAPES:
                x, w = torch.randn(m, i), torch.randn(o, i)
                inner = max(1, 2048 // max(m, 64))
                for name, fn in candidates(x, w, sorted({32, 256, m})).items():
                    key = name if not name.startswith("packed_hint") or name in ("packed_hint32", "packed_hint256") \
                        else "packed_hintM"
                    total[key] = total.get(key, 0.0) + best_ms(fn, args.repeats, inner)
            flops = 2 * m * sum(o * i for o, i in SHAPES)
            rows[str(m)] = {k: {"ms": round(v, 3), "gflops": round(flops / v / 1e6, 1)} for k, v in total.items()}
    print(json.dumps({"benchmark": "prefill_gemm", "threads": torch.get_num_threads(),
                      "isa": torch.backends.cpu.get_cpu_capability(), "shapes": SHAPES, "rows": rows}))


if __name__ == "__main__":
    main()

"""Decode attention over a cold KV pool: this tree's kernel against a baseline's, in one process.

A decode step calls ``paged_attention`` once per layer, so each call reads its layer's K/V
cold from DRAM (32 x 576 tokens of fp32 SmolLM2 K/V is 28 MB a layer). This builds the
baseline's ``paged_attention.cpp`` (e.g. main's, from ``git show``) under another op namespace
(``pdbase``), then times layer sweeps over a 30-layer pool, alternating the two kernels sweep
by sweep so host noise hits both. Also: a fresh prompt through the kernel vs causal SDPA.
Prints one JSON line. Usage:
  git show main:engine/attention/csrc/paged_attention.cpp > /tmp/base_pa.cpp
  python benchmarks/decode_attention_ab.py --baseline-src /tmp/base_pa.cpp --block-size 16 128 --threads 1
  ... --huge-pages     # the pool on 2 MiB pages (engine.huge_pages), as the engine's KVPool is
  ... --hot --batch 2  # every call on one layer (its K/V stay in cache): the kernel's compute speed
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load

from engine import huge_pages
from engine.attention.kernels import load_cpu_kernel

H, KVH, D, LAYERS = 9, 3, 64, 30


def load_baseline(src: Path) -> None:
    text = src.read_text().replace("TORCH_LIBRARY(pdserve,", "TORCH_LIBRARY(pdbase,")
    text = text.replace("TORCH_LIBRARY_IMPL(pdserve,", "TORCH_LIBRARY_IMPL(pdbase,")
    build = Path(tempfile.mkdtemp(prefix="pdbase-"))
    (build / "base_pa.cpp").write_text(text)
    load(name="pdbase_pa", sources=[str(build / "base_pa.cpp")], extra_cflags=["-O3", "-march=native", "-fopenmp",
         "-std=c++17"], extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False)


def decode_ab(batch: int, ctx: int, bs: int, sweeps: int, huge: bool, hot: bool, g: torch.Generator) -> dict:
    mb = -(-ctx // bs)
    shape = (batch * mb + 1, LAYERS, 2, KVH, bs, D)
    pool = (huge_pages.zeros(shape, dtype=torch.float32, device="cpu") if huge else torch.empty(shape)).normal_(generator=g)
    tables = (torch.randperm(batch * mb, generator=g) + 1).view(batch, mb).contiguous()
    q = torch.randn(batch, H, D, generator=g)
    qsl, ctxs = torch.arange(batch + 1), torch.full((batch,), ctx)
    ops = {"base": torch.ops.pdbase.paged_attention, "new": torch.ops.pdserve.paged_attention}
    diff = (ops["base"](q, pool, 3, tables, qsl, ctxs, D ** -0.5) - ops["new"](q, pool, 3, tables, qsl, ctxs, D ** -0.5))
    times: dict[str, list[float]] = {k: [] for k in ops}
    for i in range(sweeps):
        for name in (("base", "new") if i % 2 else ("new", "base")):
            t0 = time.perf_counter()
            for layer in range(LAYERS):
                ops[name](q, pool, 3 if hot else layer, tables, qsl, ctxs, D ** -0.5)
            times[name].append((time.perf_counter() - t0) / LAYERS * 1e3)
    nbytes = batch * ctx * KVH * D * 2 * 4
    out: dict = {"max_abs_diff": float(diff.abs().max())}
    for name, ts in times.items():
        ts.sort()
        out[name] = {"ms_per_layer_min": round(ts[0], 3), "ms_per_layer_median": round(ts[len(ts) // 2], 3),
                     "GBps_at_min": round(nbytes / ts[0] / 1e6, 1)}
    return out


def fresh_prompt(tokens: int, bs: int, g: torch.Generator) -> dict:
    q, k, v = (torch.randn(tokens, n, D, generator=g) for n in (H, KVH, KVH))
    pool = torch.randn(tokens // bs + 1, LAYERS, 2, KVH, bs, D, generator=g)
    tables = torch.arange(1, tokens // bs + 1).view(1, -1)
    qsl, ctxs = torch.tensor([0, tokens]), torch.tensor([tokens])
    cases = {"kernel": lambda: torch.ops.pdserve.paged_attention(q, pool, 3, tables, qsl, ctxs, D ** -0.5),
             "sdpa": lambda: F.scaled_dot_product_attention(
                 q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
                 enable_gqa=True)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(24):
        for name, fn in cases.items() if i % 2 else reversed(list(cases.items())):
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: round(sorted(ts[4:])[len(ts[4:]) // 2], 3) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline-src", required=True, type=Path, help="a paged_attention.cpp to compare against")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=576)
    ap.add_argument("--block-size", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--sweeps", type=int, default=10)
    ap.add_argument("--hot", action="store_true", help="every call on one layer, whose K/V stay in cache "
                    "(with a small --batch): the kernel's compute speed rather than DRAM's")
    ap.add_argument("--huge-pages", action="store_true", help="the pool on 2 MiB pages, as KVPool allocates it")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    why = load_cpu_kernel()
    if why is not None:
        raise SystemExit(f"the kernel did not build: {why}")
    load_baseline(args.baseline_src)
    g = torch.Generator().manual_seed(0)
    res = {f"decode_bs{bs}": decode_ab(args.batch, args.ctx, bs, args.sweeps, args.huge_pages, args.hot, g) for bs in args.block_size}
    res.update({f"fresh_prompt_{n}_ms": fresh_prompt(n, 16, g) for n in (128, 512)})
    print(json.dumps({"bench": "decode_attention_ab", "batch": args.batch, "ctx": args.ctx, "huge_pages": args.huge_pages, "hot": args.hot,
                      "threads": torch.get_num_threads(), **res}))


if __name__ == "__main__":
    main()

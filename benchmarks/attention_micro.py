"""Attention ms/layer at SmolLM2 shapes: contiguous SDPA vs the paged backends.

Decode: batch 16 x 512 tokens of context (and batch 1 x 512), 9 query heads / 3 KV
heads / head dim 64, block 16, pool of 30 layers: contiguous SDPA, a block gather +
permute + SDPA, ``torch_paged`` (gathered copy + matmuls) and ``cpu_paged`` (C++ kernel
over the pool, where it builds). Prefill: 8 prompts x 128 new tokens, fresh and after a
256-token cached prefix, for both backends. Prints one JSON line. Optional argument: threads.
"""
from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from engine.attention import AttentionShape, get_attention_backend
from engine.attention.kernels import cpu_kernel_available
from engine.batch import AttentionMetadata

B, CTX, H, KVH, D, BS, LAYERS = 16, 512, 9, 3, 64, 16, 30


def timeit(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return round(ts[0] * 1e3, 3)   # min: this box is shared, the median is mostly noise


def bench(dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    mb = CTX // BS
    nblocks = B * mb + 1
    pool = torch.randn(nblocks, LAYERS, 2, KVH, BS, D, generator=g).to(dtype)
    perm = torch.randperm(nblocks - 1, generator=g) + 1
    tables = perm[:B * mb].view(B, mb)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    kc = torch.randn(B, KVH, CTX, D, generator=g).to(dtype)
    vc = torch.randn(B, KVH, CTX, D, generator=g).to(dtype)
    contiguous = timeit(lambda: F.scaled_dot_product_attention(q.view(B, KVH, H // KVH, D), kc, vc))
    layer = 7

    def block_gather():
        blocks = pool[:, layer].index_select(0, tables.reshape(-1)).view(B, mb, 2, KVH, BS, D)
        k = blocks[:, :, 0].permute(0, 2, 1, 3, 4).reshape(B, KVH, CTX, D)
        v = blocks[:, :, 1].permute(0, 2, 1, 3, 4).reshape(B, KVH, CTX, D)
        return F.scaled_dot_product_attention(q.view(B, KVH, H // KVH, D), k, v)

    out = {"dtype": str(dtype).replace("torch.", ""), "contiguous_sdpa_ms": contiguous,
           "block_gather_permute_ms": timeit(block_gather)}
    for name in BACKENDS:
        backend = get_attention_backend(name, AttentionShape(LAYERS, H, KVH, D, BS))
        for label, qlen, prefix, seqs in CASES:
            meta = _metadata(tables[:seqs], qlen, prefix)
            plan = backend.plan(meta, pool)
            t = seqs * qlen
            qq = torch.randn(t, H, D, generator=g).to(dtype)
            kv_new = torch.randn(t, KVH, D, generator=g).to(dtype)
            out[f"{name}_{label}_ms"] = timeit(lambda: backend.forward(plan, layer, qq, kv_new, kv_new))
        out[f"{name}_plan_ms_per_step"] = timeit(lambda: backend.plan(_metadata(tables, 1, CTX - 1), pool))
    return out


# (label, new tokens per sequence, cached prefix, sequences)
CASES = (("decode_b16", 1, CTX - 1, B), ("decode_b1", 1, CTX - 1, 1),
         ("prefill_8x128_fresh", 128, 0, 8), ("prefill_8x128_after_256", 128, 256, 8))
BACKENDS = ("torch_paged", "cpu_paged") if cpu_kernel_available() else ("torch_paged",)


def _metadata(tables: torch.Tensor, qlen: int, prefix: int) -> AttentionMetadata:
    seqs = tables.shape[0]
    ctx = prefix + qlen
    pos = torch.arange(prefix, ctx)
    slots = (tables[:, pos // BS] * BS + pos % BS).reshape(-1)
    return AttentionMetadata(slot_mapping=slots, query_lens=torch.full((seqs,), qlen),
                             context_lens=torch.full((seqs,), ctx),
                             query_start_loc=torch.arange(seqs + 1) * qlen,
                             block_tables=tables, num_prefills=seqs if qlen > 1 else 0,
                             num_prefill_tokens=seqs * qlen if qlen > 1 else 0,
                             max_query_len=qlen, max_context_len=ctx, block_size=BS)


def main() -> None:
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    res = [bench(dt) for dt in (torch.float32, torch.bfloat16)]
    print(json.dumps({"benchmark": "attention_micro", "batch": B, "ctx": CTX, "block_size": BS,
                      "threads": torch.get_num_threads(), "results": res}))


if __name__ == "__main__":
    main()

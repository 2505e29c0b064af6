"""Decode attention ms/layer at SmolLM2 shapes: contiguous SDPA vs the paged path.

Batch 16 x 512 tokens of context, 9 query heads / 3 KV heads / head dim 64,
block 16, pool of 30 layers. Prints one JSON line. Optional argument: threads.
"""
from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from engine.attention import AttentionShape, get_attention_backend
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

    backend = get_attention_backend("torch_paged", AttentionShape(LAYERS, H, KVH, D, BS))
    ctx = torch.full((B,), CTX)
    slots = tables[:, -1] * BS + (BS - 1)
    meta = AttentionMetadata(slot_mapping=slots, query_lens=torch.ones(B, dtype=torch.long),
                             context_lens=ctx, query_start_loc=torch.arange(B + 1),
                             block_tables=tables, num_prefills=0, num_prefill_tokens=0,
                             max_query_len=1, max_context_len=CTX, block_size=BS)
    plan = backend.plan(meta, pool)
    kv_new = torch.randn(B, KVH, D, generator=g).to(dtype)
    paged = timeit(lambda: backend.forward(plan, layer, q, kv_new, kv_new))
    plan_ms = timeit(lambda: backend.plan(meta, pool))

    return {"dtype": str(dtype).replace("torch.", ""), "contiguous_sdpa_ms": contiguous,
            "block_gather_permute_ms": timeit(block_gather), "torch_paged_ms": paged,
            "plan_ms_per_step": plan_ms}


def main() -> None:
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    res = [bench(dt) for dt in (torch.float32, torch.bfloat16)]
    print(json.dumps({"benchmark": "attention_micro", "batch": B, "ctx": CTX, "block_size": BS,
                      "threads": torch.get_num_threads(), "results": res}))


if __name__ == "__main__":
    main()

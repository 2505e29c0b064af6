"""KV hand-off between pools of different tensor-parallel sizes: bytes and descriptors per
decode rank, planned (kvtransfer/head_plan.py) and measured (real tcp transfer engines on
loopback, one pool per rank, every decode rank reading its heads from the prefill ranks that
hold them, then the notify-only read that ends the lease: kvtransfer/head_read.py).

Shapes: the tiny test Llama (3 layers, 2 KV heads, head_dim 16, fp32) and a Llama-3-8B-like
one (32 layers, 8 KV heads, head_dim 128, bf16), block 16. For each (prefill TP, decode TP)
mix: per decode rank the bytes and descriptors of one hand-off of `--blocks` blocks (in
`--runs` runs of consecutive blocks), which prefill ranks it reads, and the measured seconds.
Prints one JSON line.

    python benchmarks/tp_handoff.py [--blocks 32] [--runs 4] [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kvtransfer.handle import RankSource
from kvtransfer.head_plan import head_shards
from kvtransfer.head_read import notify_source, plan_rank_read, read_heads
from kvtransfer.layout import KVPoolLayout
from kvtransfer.tcp_backend import TcpEngine

SHAPES = {"tiny-llama": dict(layers=3, kv_heads=2, head_dim=16, dtype=torch.float32),
          "llama3-8b-like": dict(layers=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)}
MIXES = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (1, 4)]
BLOCK = 16


def _side(name: str, shape: dict, tp: int, num_blocks: int) -> tuple[list[TcpEngine], list[RankSource], list]:
    shards = head_shards(shape["kv_heads"], tp)
    pools = [torch.ones(num_blocks, shape["layers"], 2, s.num_heads, BLOCK, shape["head_dim"], dtype=shape["dtype"])
             for s in shards]
    engines = [TcpEngine(f"{name}-rank{r}") for r in range(tp)]
    for e, p in zip(engines, pools):
        e.register_pool(KVPoolLayout.from_tensor(p))
    return engines, [RankSource(e.peer_info(), s) for e, s in zip(engines, shards)], pools


def _ids(blocks: int, runs: int) -> tuple[list[int], list[int]]:
    """`blocks` source blocks in `runs` runs of consecutive ids, read into consecutive destination ids."""
    per = blocks // runs
    src = [r * (per + 1) + i for r in range(runs) for i in range(per)]
    return src, list(range(len(src)))


def measure(shape: dict, p_tp: int, d_tp: int, blocks: int, runs: int, reps: int) -> dict:
    src_ids, dst_ids = _ids(blocks, runs)
    num_blocks = max(src_ids) + 1
    p_eng, p_src, p_pools = _side("p", shape, p_tp, num_blocks)      # the pools live as long as their engines
    d_eng, d_src, d_pools = _side("d", shape, d_tp, num_blocks)
    try:
        ranks = []
        for r, (eng, src) in enumerate(zip(d_eng, d_src)):
            plan = plan_rank_read(p_src, src.shard, r, eng.layout, shape["layers"])
            res = read_heads(eng, p_src, src.shard, r, shape["layers"], src_ids, dst_ids, 60.0)   # warm-up
            assert res.ok, res.error
            t0 = time.perf_counter()
            for _ in range(reps):
                res = read_heads(eng, p_src, src.shard, r, shape["layers"], src_ids, dst_ids, 60.0)
            seconds = (time.perf_counter() - t0) / reps
            ranks.append(dict(rank=r, heads=[src.shard.first_head, src.shard.end],
                              reads_from=[p.agent_name for p, _ in plan], bytes=res.nbytes,
                              descriptors=res.descriptors, seconds=round(seconds, 5)))
        assert notify_source(d_eng[0], p_src[0].peer, b"", 10.0).ok
        return dict(prefill_tp=p_tp, decode_tp=d_tp, total_bytes=sum(r["bytes"] for r in ranks), ranks=ranks)
    finally:
        for e in p_eng + d_eng:
            e.close()
        del p_pools, d_pools


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out: dict = {"bench": "tp_handoff", "backend": "tcp", "block_size": BLOCK, "blocks": args.blocks,
                 "runs": args.runs, "shapes": {}}
    for name, shape in SHAPES.items():
        mixes = [m for m in MIXES if max(m) <= shape["kv_heads"] * 2]
        out["shapes"][name] = [measure(shape, p, d, args.blocks, args.runs, args.reps) for p, d in mixes]
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Tensor-parallel communication per engine step on this host, TP 2, gloo on CPU (NCCL with --device cuda).

One step of a TP engine (engine/parallel/) communicates: the control broadcast of the step's
inputs from rank 0 (a pickled StepMessage), 2 * layers + 1 all-reduces of ``[tokens, hidden]``
(the embedding, then o_proj and down in every layer) and one gather of the sampled rows'
logit slices to rank 0. This times each on two spawned ranks at the tiny test model's shape
and at SmolLM2-135M's (hidden 576, 30 layers, vocab 49152), for a decode step of 1 and 16
sequences and a 512-token prefill chunk; then, side by side, the tiny model's whole decode
step through `LLM` at TP 1 and TP 2 (16 sequences). Prints one JSON line.

    python benchmarks/tp_allreduce.py [--reps 50] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from engine.batch import AttentionMetadata, BatchInput
from engine.model_runner import StepInputs
from engine.parallel.group import Rendezvous, TPGroup, rank_device
from engine.parallel.rank import StepMessage

SHAPES = {"tiny": dict(hidden=64, layers=3, vocab=384), "smollm2": dict(hidden=576, layers=30, vocab=49152)}
CASES = [("decode", 1, 1), ("decode", 16, 16), ("prefill", 512, 1)]     # (kind, tokens, sampled rows)
TP = 2


def _message(tokens: int, seqs: int, blocks_per_seq: int = 8) -> StepMessage:
    def t(n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int64)
    attn = AttentionMetadata(slot_mapping=t(tokens), query_lens=t(seqs), context_lens=t(seqs),
                             query_start_loc=t(seqs + 1), block_tables=t(seqs * blocks_per_seq).view(seqs, -1),
                             num_prefills=0, num_prefill_tokens=0, max_query_len=1, max_context_len=128,
                             block_size=16)
    return StepMessage([], StepInputs(BatchInput(t(tokens), t(tokens), attn, t(seqs)), seqs))


def _time(group: TPGroup, fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs, every rank in step."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        group.all_gather(None)                   # line the ranks up
        t0 = time.perf_counter()
        fn()
        if group.device.startswith("cuda"):
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    out.sort()
    return round(out[len(out) // 2] * 1e3, 4)


def _case(group: TPGroup, shape: str, kind: str, tokens: int, sampled: int, reps: int) -> dict:
    s = SHAPES[shape]
    dev = group.device
    x = torch.randn(tokens, s["hidden"], device=dev)
    logits = torch.randn(sampled, s["vocab"] // TP, device=dev)
    seqs = 1 if kind == "prefill" else tokens
    msg = _message(tokens, seqs)
    n_reduce = 2 * s["layers"] + 1
    one = _time(group, lambda: group.all_reduce(x), reps)
    reduces = _time(group, lambda: [group.all_reduce(x) for _ in range(n_reduce)], max(5, reps // 5))
    gather = _time(group, lambda: group.gather_last_dim(logits), reps)
    control = _time(group, lambda: group.broadcast(msg if group.rank == 0 else None), reps)
    return dict(shape=shape, kind=kind, tokens=tokens, hidden=s["hidden"], all_reduces_per_step=n_reduce,
                all_reduce_ms=one, all_reduces_ms=reduces, logits_gather_ms=gather, control_broadcast_ms=control,
                step_comm_ms=round(reduces + gather + control, 4))


def _rank(rank: int, init: str, device: str, reps: int, queue) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // TP))
    group = TPGroup(rank=rank, world_size=TP, device=rank_device(device, rank))
    group.connect(init)
    try:
        rows = [_case(group, shape, kind, tokens, sampled, reps)
                for shape in SHAPES for kind, tokens, sampled in CASES]
        if rank == 0:
            queue.put(rows)
    finally:
        group.destroy()


def _engine_steps(device: str) -> dict:
    """Decode ms per step of the tiny model through LLM at TP 1 and TP 2 (16 sequences x 32 tokens)."""
    from cluster.tools.tiny_models import make_tiny_model
    from engine import LLM, SamplingParams

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", "llama")
        prompts = [[3 + (i * 7 + j) % 300 for j in range(24)] for i in range(16)]
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        for tp in (1, 2):
            with LLM(str(model), device=device, tensor_parallel_size=tp, num_kv_blocks=128,
                     max_model_len=128) as llm:
                llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
                t0 = time.perf_counter()
                llm.generate(prompts, params)
                out[f"tiny_generate_tp{tp}_ms_per_step"] = round((time.perf_counter() - t0) * 1e3 / 32, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    meet = Rendezvous.listen(TP)     # the store lives here; both ranks join it
    procs = [ctx.Process(target=_rank, args=(r, meet.address, args.device, args.reps, queue)) for r in range(TP)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join()
    result = dict(bench="tp_allreduce", tp=TP, backend="nccl" if args.device.startswith("cuda") else "gloo",
                  device=args.device, cpus=os.cpu_count(), torch=torch.__version__, cases=rows,
                  **_engine_steps(args.device))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

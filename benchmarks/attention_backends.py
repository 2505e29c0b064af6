"""cpu_paged against torch_paged on this CPU: one attention layer, and whole engine runs.

`attention_backend="auto"` picks cpu_paged (the C++ kernel over the pool: 16-float vectors with
AVX-512, 8-float ones elsewhere) where it builds, and it runs every step in its kernel
(engine/attention/cpu_paged.py). This script measures what that rests on, side by side in one
process:

- ``layer``: one layer's attention, cpu_paged always in its kernel (SmolLM2-135M shapes: 9 query heads, 3 KV heads, head dim
  64, block 16, 1 torch thread), the fastest of several calls, for a long prompt's later chunk
  after a cached prefix, fresh prompts, and decodes at long and short context, with SDPA on a
  contiguous copy beside them as the reference (GFLOPS counts the visible query-key pairs);
- ``engine``: `LLM.generate` with each backend, and ``cpu_paged_torch_prefill`` (cpu_paged with
  steps that carry prefill work sent to torch_paged: the rule on AVX2 from 2026-11-28 to
  2026-11-29), greedy, token ids: a 4,000-token prompt
  (prefill tokens/s), a follow-up turn sharing its first 3,840 tokens with 256 new ones
  (the multi-turn hit the routing replay is made of), 8 prompts x 128 in / 32 out, and batch 1
  x 64 out; both backends' tokens are compared.

    .venv/bin/python benchmarks/attention_backends.py [--threads 1] [--skip-engine]

Prints one JSON line with the CPU's vector ISA.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

from engine.attention import AttentionShape, get_attention_backend
from engine.attention.backend import resolve_backend_name
from engine.attention.cpu_paged import CpuPagedAttention
from engine.attention.kernels import cpu_kernel_available
from engine.batch import AttentionMetadata
from engine.cpu_features import cpu_flags

H, KVH, D, LAYERS, BS = 9, 3, 64, 30, 16
BACKENDS = ("cpu_paged", "torch_paged")
# (label, new tokens, cached prefix)
LAYER_CASES = (("prefill_256_after_3840", 256, 3840), ("prefill_2048_fresh", 2048, 0),
               ("prefill_512_fresh", 512, 0), ("decode_ctx_4096", 1, 4095), ("decode_ctx_512", 1, 511))


def isa() -> list[str]:
    flags = cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"}
    return sorted(flags) or [platform.machine()]


def fastest_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def layer_case(qlen: int, prefix: int, backends: tuple[str, ...]) -> dict:
    g = torch.Generator().manual_seed(0)
    ctx = prefix + qlen
    mb = (ctx + BS - 1) // BS
    pool = torch.randn(mb + 1, LAYERS, 2, KVH, BS, D, generator=g)
    tables = (torch.randperm(mb, generator=g) + 1).view(1, mb)
    pos = torch.arange(prefix, ctx)
    meta = AttentionMetadata(slot_mapping=(tables[:, pos // BS] * BS + pos % BS).reshape(-1),
                             query_lens=torch.tensor([qlen]), context_lens=torch.tensor([ctx]),
                             query_start_loc=torch.tensor([0, qlen]), block_tables=tables,
                             num_prefills=1 if qlen > 1 else 0, num_prefill_tokens=qlen if qlen > 1 else 0,
                             max_query_len=qlen, max_context_len=ctx, block_size=BS)
    q = torch.randn(qlen, H, D, generator=g)
    kv = torch.randn(qlen, KVH, D, generator=g)
    reps = 3 if qlen * ctx > 2_000_000 else 10
    out: dict = {}
    for name in backends:
        shape = AttentionShape(LAYERS, H, KVH, D, BS)
        be = CpuPagedAttention(shape, prefill_in_kernel=True) if name == "cpu_paged" else get_attention_backend(name, shape)
        plan = be.plan(meta, pool)
        out[f"{name}_ms"] = round(fastest_ms(lambda: be.forward(plan, 7, q, kv, kv), reps), 3)
    k, v = torch.randn(1, KVH, ctx, D, generator=g), torch.randn(1, KVH, ctx, D, generator=g)
    qq = q.transpose(0, 1).unsqueeze(0).contiguous()
    mask = torch.ones(qlen, ctx, dtype=torch.bool).tril(prefix)
    out["sdpa_contiguous_ms"] = round(fastest_ms(
        lambda: F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, enable_gqa=True), reps), 3)
    gflop = 4 * H * D * (qlen * prefix + qlen * (qlen + 1) / 2) / 1e9
    for key in [k for k in out if k.endswith("_ms")]:
        out[key.replace("_ms", "_gflops")] = round(gflop / out[key] * 1e3, 1)
    return out


def engine_runs(arm: str, vocab_floor: int = 100) -> tuple[dict, list[list[int]]]:
    from engine import LLM, SamplingParams

    llm = LLM(attention_backend=arm.removesuffix("_torch_prefill"), kv_cache_memory_bytes=1 << 30,
              max_model_len=4200)
    if arm.endswith("_torch_prefill"):
        llm.engine.runner.attention.prefill_in_kernel = False
    try:
        vocab = llm.engine.vocab_size
        ids = [(vocab_floor + (i * 7919) % (vocab - vocab_floor)) for i in range(4000)]
        greedy = dict(temperature=0.0, ignore_eos=True)
        tokens: list[list[int]] = []
        out: dict = {}
        t0 = time.perf_counter()
        r = llm.generate([ids], SamplingParams(max_tokens=1, **greedy))
        out["prefill_4000_tok_s"] = round(4000 / (time.perf_counter() - t0), 1)
        tokens += [o.outputs[0].token_ids for o in r]
        follow = ids[:3840] + [(vocab_floor + (i * 104729) % (vocab - vocab_floor)) for i in range(256)]
        t0 = time.perf_counter()
        r = llm.generate([follow], SamplingParams(max_tokens=1, **greedy))
        out["turn_256_after_3840_s"] = round(time.perf_counter() - t0, 3)
        tokens += [o.outputs[0].token_ids for o in r]
        batch = [[(vocab_floor + (j * 31 + i * 13) % (vocab - vocab_floor)) for i in range(128)] for j in range(8)]
        t0 = time.perf_counter()
        r = llm.generate(batch, SamplingParams(max_tokens=32, **greedy))
        out["batch8_128in_32out_tok_s"] = round(8 * 32 / (time.perf_counter() - t0), 1)
        tokens += [o.outputs[0].token_ids for o in r]
        t0 = time.perf_counter()
        r = llm.generate([batch[0][:64]], SamplingParams(max_tokens=64, **greedy))
        out["batch1_64out_tok_s"] = round(64 / (time.perf_counter() - t0), 1)
        tokens += [o.outputs[0].token_ids for o in r]
        return out, tokens
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-engine", action="store_true", help="the layer figures only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backends = BACKENDS if cpu_kernel_available() else ("torch_paged",)
    res: dict = {"benchmark": "attention_backends", "isa": isa(), "threads": torch.get_num_threads(),
                 "auto_picks": resolve_backend_name("auto"),
                 "layer": {label: layer_case(n, c, backends) for label, n, c in LAYER_CASES}}
    if not args.skip_engine:
        arms = backends + (("cpu_paged_torch_prefill",) if "cpu_paged" in backends else ())
        runs = {a: engine_runs(a) for a in arms}
        res["engine"] = {b: r[0] for b, r in runs.items()}
        res["engine_tokens_agree"] = len({json.dumps(r[1]) for r in runs.values()}) == 1
    print(json.dumps(res))


if __name__ == "__main__":
    main()

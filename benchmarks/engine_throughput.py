"""Engine throughput: pdserve's engine vs Hugging Face transformers `generate`,
side by side on the same weights and the same workload, in one run.

Workload: N prompts (lengths uniform in [32, 512]), output lengths uniform in
[16, 256], greedy, ignore_eos. transformers runs at its best batching we know:
prompts sorted by output length, left-padded batches of --hf-batch; only each
prompt's own output tokens count. Also: batch-1 decode tokens/s beside the
memory-bandwidth roofline measured in the same run (bytes read per decode
step / measured streaming read bandwidth). fp32 is the parity setting; bf16
beside it. Prints one JSON line.

  python benchmarks/engine_throughput.py                 # SmolLM2, 64 prompts (slow on 2 cores)
  python benchmarks/engine_throughput.py --num-prompts 16 --max-out 64
  python benchmarks/engine_throughput.py --with-llama-cpp  # if llama-cpp-python is installed
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.loader.load import load_model_source, resolve_model_path


def workload(n: int, vocab: int, min_in: int, max_in: int, min_out: int, max_out: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(min_in, max_in))] for _ in range(n)]
    outs = [rng.randint(min_out, max_out) for _ in range(n)]
    return prompts, outs


def read_bandwidth_gbs() -> float:
    x = torch.ones(64 << 20, dtype=torch.float32)     # 256 MiB
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def run_pdserve(model, dtype, prompts, outs, max_model_len) -> dict:
    llm = LLM(model, dtype=dtype, max_model_len=max_model_len, kv_cache_memory_bytes=2 << 30,
              max_num_seqs=64, max_num_batched_tokens=2048)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))     # warm-up
    t = time.perf_counter()
    res = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    ntok = sum(len(r.token_ids) for r in res)
    # batch-1 decode: a 128-token prompt, 64 output tokens, time per token after the first
    p1 = prompts[0][:128]
    t0 = time.perf_counter()
    llm.generate([p1], SamplingParams(max_tokens=1, temperature=0.0))
    t_first = time.perf_counter() - t0
    llm.engine.scheduler.kv.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate([p1], SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True))
    b1 = 64 / max(1e-9, time.perf_counter() - t0 - t_first)
    return {"output_tokens": ntok, "seconds": round(dt, 2), "tok_s": round(ntok / dt, 1),
            "batch1_decode_tok_s": round(b1, 1), "tokens": [r.token_ids for r in res]}


def run_hf(model_path, dtype, prompts, outs, batch) -> dict:
    from cluster.tools.tiny_models import hf_llama_from_state
    import transformers

    if Path(model_path).is_dir():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).eval()
    else:
        cfg, state = load_model_source(model_path)
        hf = hf_llama_from_state(cfg, state).to(dtype)
    order = sorted(range(len(prompts)), key=lambda i: outs[i])
    ntok, t = 0, time.perf_counter()
    tokens: dict[int, list[int]] = {}
    gen_cfg = hf.generation_config
    gen_cfg.eos_token_id, gen_cfg.pad_token_id = None, 0
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max(outs[i] for i in idx), do_sample=False,
                              generation_config=gen_cfg)
        for r, i in enumerate(idx):
            tokens[i] = out[r, width:width + outs[i]].tolist()
            ntok += outs[i]
    dt = time.perf_counter() - t
    return {"output_tokens": ntok, "seconds": round(dt, 2), "tok_s": round(ntok / dt, 1), "batch": batch,
            "tokens": [tokens[i] for i in range(len(prompts))]}


def run_llama_cpp(path, prompts, outs) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=1024, n_threads=torch.get_num_threads(), verbose=False)
    t, ntok = time.perf_counter(), 0
    for p, o in zip(prompts, outs):
        llm.reset()
        n = 0
        for _ in llm.generate(p, temp=0.0, reset=True):
            n += 1
            if n >= o:
                break
        ntok += n
    dt = time.perf_counter() - t
    return {"output_tokens": ntok, "seconds": round(dt, 2), "tok_s": round(ntok / dt, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: bundled SmolLM2)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-in", type=int, default=32)
    ap.add_argument("--max-in", type=int, default=512)
    ap.add_argument("--min-out", type=int, default=16)
    ap.add_argument("--max-out", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--with-llama-cpp", action="store_true")
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    cfg, _ = load_model_source(path)
    prompts, outs = workload(args.num_prompts, cfg.vocab_size, args.min_in, args.max_in, args.min_out,
                             args.max_out, args.seed)
    max_len = args.max_in + args.max_out + 8
    bw = read_bandwidth_gbs()
    result: dict = {"bench": "engine_throughput", "model": path.name, "num_prompts": args.num_prompts,
                    "input_len": [args.min_in, args.max_in], "output_len": [args.min_out, args.max_out],
                    "read_bandwidth_gbs": round(bw, 1), "threads": torch.get_num_threads(),
                    "machine": platform.machine()}
    n_params = sum(v.numel() for k, v in load_model_source(path)[1].items())
    for dtype in args.dtypes.split(","):
        tdt = getattr(torch, dtype)
        ours = run_pdserve(str(path), dtype, prompts, outs, max_len)
        hf = run_hf(path, tdt, prompts, outs, args.hf_batch)
        bytes_per_step = n_params * torch.finfo(tdt).bits // 8
        roofline = bw * 1e9 / bytes_per_step
        same = sum(a == b for a, b in zip(ours.pop("tokens"), hf.pop("tokens")))
        result[dtype] = {"pdserve": ours, "transformers": hf, "ratio_vs_transformers": round(ours["tok_s"] / hf["tok_s"], 2),
                         "batch1_roofline_tok_s": round(roofline, 1),
                         "batch1_fraction_of_roofline": round(ours["batch1_decode_tok_s"] / roofline, 2),
                         "greedy_outputs_identical": f"{same}/{len(prompts)}"}
    if args.with_llama_cpp:
        try:
            result["llama_cpp"] = run_llama_cpp(path, prompts, outs)
        except ImportError:
            result["llama_cpp"] = "llama-cpp-python not installed"
    print(json.dumps(result))


if __name__ == "__main__":
    main()

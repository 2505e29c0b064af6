"""Quality of a quantized KV cache (int8, fp8_e4m3) against the unquantized one.

For each kv_cache_dtype, on the same weights: greedy generation over a fixed
set of prompts, compared with the ``auto`` (model dtype) run:

- ``prefix_agreement``: share of the reference's generated tokens that are
  identical up to the first divergence (summed over prompts);
- ``exact_match``: share of prompts whose whole output is identical;
- ``logprob_abs_diff_mean`` / ``_max``: absolute difference of the chosen
  tokens' logprobs, over the positions before the first divergence (same
  context on both sides);
- ``perplexity`` of a fixed text, teacher-forced in chunks whose attention
  reads every earlier token's K/V back from the (quantized) pool.

Prints ONE JSON line: {model: {kv_cache_dtype: metrics}}.

  .venv/bin/python benchmarks/kv_quant_quality.py                  # SmolLM2-135M + the tiny models
  .venv/bin/python benchmarks/kv_quant_quality.py --models tiny-llama tiny-qwen2 --max-tokens 32
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model_source
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledSeq, SchedulerOutput

PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
    "List three fruits:",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "What is 12 times 7?",
)
TEXT = ("Paged attention stores the keys and values of every token in fixed-size blocks, so that the "
        "memory of a sequence need not be contiguous. A block table maps each sequence's logical blocks "
        "to physical blocks in a shared pool. When two requests begin with the same prompt, they can share "
        "the blocks of that prefix, and a new request finds them by hashing its tokens block by block. "
        "Quantizing the cache to eight bits halves the memory a token needs compared with sixteen-bit "
        "values, so the same pool holds twice as many tokens, and a disaggregated cluster moves half as "
        "many bytes when it hands a prompt's cache from a prefill node to a decode node.")
KV_DTYPES = ("auto", "int8", "fp8_e4m3")


@dataclass
class Run:
    tokens: list[list[int]]
    logprobs: list[list[float]]


def make_runner(weights, kv_cache_dtype: str, *, num_blocks: int, max_model_len: int,
                dtype: str = "float32") -> tuple[ModelRunner, CacheConfig]:
    model_config, state = weights
    cache = CacheConfig(block_size=16, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype)
    return ModelRunner(model_config, state, cache_config=cache, max_model_len=max_model_len,
                       dtype=dtype), cache


def greedy(weights, model_path: str, kv_cache_dtype: str, prompts: list[list[int]], max_tokens: int,
           *, num_blocks: int = 256, max_model_len: int = 512, dtype: str = "float32",
           after_step: Callable[[LLMEngine], None] | None = None) -> Run:
    """Greedy outputs and the chosen tokens' logprobs, all prompts in one continuous batch.
    ``after_step(engine)`` runs after every engine step (tests inject faults with it)."""
    runner, cache = make_runner(weights, kv_cache_dtype, num_blocks=num_blocks, max_model_len=max_model_len,
                                dtype=dtype)
    config = EngineConfig(model=model_path, dtype=dtype, cache=cache,
                          scheduler=SchedulerConfig(max_model_len=max_model_len))
    engine = LLMEngine(config, runner=runner)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    toks: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    lps: dict[str, list[float]] = {f"p{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for d in engine.step():
            toks[d.request_id].extend(d.new_token_ids)
            lps[d.request_id].extend(lp.logprob for lp in d.logprobs)
        if after_step is not None:
            after_step(engine)
    return Run([toks[f"p{i}"] for i in range(len(prompts))], [lps[f"p{i}"] for i in range(len(prompts))])


def compare(ref: Run, test: Run) -> dict:
    """Greedy agreement and logprob differences of ``test`` against ``ref``."""
    same = total = exact = 0
    diffs: list[float] = []
    for rt, tt, rl, tl in zip(ref.tokens, test.tokens, ref.logprobs, test.logprobs):
        n = 0
        while n < min(len(rt), len(tt)) and rt[n] == tt[n]:
            n += 1
        same += n
        total += len(rt)
        exact += rt == tt
        # the token at the divergence still had the same context: its logprob counts too
        diffs.extend(abs(a - b) for a, b in zip(rl[:n + 1], tl[:n + 1]))
    return {"prefix_agreement": round(same / total, 4), "exact_match": round(exact / len(ref.tokens), 4),
            "logprob_abs_diff_mean": round(sum(diffs) / len(diffs), 6), "logprob_abs_diff_max": round(max(diffs), 6),
            "tokens": total}


@torch.inference_mode()
def perplexity(runner: ModelRunner, token_ids: list[int], chunk: int = 32) -> float:
    """exp(mean NLL) of ``token_ids[1:]``, computed chunk by chunk through the pool."""
    bs = runner.block_size
    n = len(token_ids)
    need = -(-n // bs)
    if need > runner.num_blocks:
        raise ValueError(f"the text needs {need} blocks; the runner has {runner.num_blocks}")
    req = Request(request_id="ppl", prompt_token_ids=list(token_ids), sampling_params=SamplingParams())
    blocks = list(range(need))
    nll = 0.0
    while req.num_computed_tokens < n:
        k = min(chunk, n - req.num_computed_tokens)
        start = req.num_computed_tokens
        inputs = runner.build_inputs(SchedulerOutput(seqs=[ScheduledSeq(req, k, blocks, True)]))
        inputs.batch.logits_indices = torch.arange(k)
        logits = runner.model(inputs.batch, runner.kv_pool.tensor).float()
        logp = torch.log_softmax(logits, dim=-1)
        targets = token_ids[start + 1:start + k + 1]
        nll -= float(logp[torch.arange(len(targets)), torch.tensor(targets)].sum())
        req.num_computed_tokens += k
    return math.exp(nll / (n - 1))


def evaluate(model_path: str, prompts: list[list[int]], text: list[int], *, max_tokens: int,
             kv_dtypes=KV_DTYPES, dtype: str = "float32", chunk: int = 32) -> dict:
    weights = load_model_source(model_path or None)
    max_len = max(max(len(p) for p in prompts) + max_tokens, len(text)) + 16
    blocks = len(prompts) * (-(-max_len // 16)) + 8
    runs = {kv: greedy(weights, model_path, kv, prompts, max_tokens, num_blocks=blocks, max_model_len=max_len,
                       dtype=dtype) for kv in kv_dtypes}
    out = {}
    for kv in kv_dtypes:
        runner, _ = make_runner(weights, kv, num_blocks=-(-max_len // 16), max_model_len=max_len, dtype=dtype)
        out[kv] = {**compare(runs["auto"], runs[kv]), "perplexity": round(perplexity(runner, text, chunk), 4),
                   "bytes_per_token": runner.kv_pool.capacity.kv_bytes_per_token}
    return out


def tiny_model_path(name: str, tmp: Path, weight_scale: float = 20.0) -> str:
    """tiny-llama / tiny-qwen2 as the tests build them (``weight_scale`` 20 is the fixtures')."""
    from cluster.tools.tiny_models import make_tiny_model
    if name == "tiny-llama":
        return str(make_tiny_model(tmp / "llama", "llama", weight_scale=weight_scale))
    return str(make_tiny_model(tmp / "qwen2", "qwen2", tie_word_embeddings=True, weight_scale=weight_scale))


def _model_path(name: str, tmp: Path, weight_scale: float) -> str:
    if name == "smollm2":
        return ""
    if name in ("tiny-llama", "tiny-qwen2"):
        return tiny_model_path(name, tmp, weight_scale)
    return name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2", "tiny-llama", "tiny-qwen2"],
                   help="smollm2 (the default GGUF), tiny-llama, tiny-qwen2, or an HF dir / .gguf path")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--dtype", default="float32", help="model dtype (what auto stores)")
    p.add_argument("--tiny-weight-scale", type=float, default=20.0,
                   help="random weights' scale of the tiny models (20 = the test fixtures'; the quality "
                        "tests use 6: less chaotic, so quantization error and corruption stand apart)")
    args = p.parse_args()
    torch.set_num_threads(2)
    results = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = _model_path(name, Path(tmp), args.tiny_weight_scale)
            from engine.tokenizer import Tokenizer
            from engine.loader.load import resolve_model_path
            tok = Tokenizer.load(resolve_model_path(path or None))
            prompts = [tok.encode(s) for s in PROMPTS]
            text = tok.encode(TEXT)
            results[name] = evaluate(path, prompts, text, max_tokens=args.max_tokens, dtype=args.dtype)
    print(json.dumps({"bench": "kv_quant_quality", "max_tokens": args.max_tokens, "prompts": len(PROMPTS),
                      "dtype": args.dtype, "tiny_weight_scale": args.tiny_weight_scale, "seconds": round(time.perf_counter() - t0, 1), "results": results}))


if __name__ == "__main__":
    main()

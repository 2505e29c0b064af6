"""Token-level quality of int8 / fp8 KV against the unquantized engine, within
bounds set from benchmarks/kv_quant_quality.py (docs/kv_quantization.md):

  kv_quant_quality.py --models tiny-llama --max-tokens 24 --tiny-weight-scale 6
  int8: logprob |diff| mean 0.0072, max 0.025, prefix agreement 0.91
  fp8:  logprob |diff| mean 0.0285, max 0.077

The bounds are about 3x those figures, and a floor: a run that does not
quantize (auto) or whose scales were corrupted must fail them (checked below).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from engine.kv_quant import SCALE_DTYPE
from engine.loader import load_model_source
from engine.tokenizer import Tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_quant_quality.py"
BOUNDS = {   # kv dtype -> (max mean |dlogprob|, max max |dlogprob|, min prefix agreement)
    "int8": (0.02, 0.08, 0.6),
    "fp8_e4m3": (0.07, 0.25, 0.1),
}
MIN_MEAN_DIFF = 1e-4    # a quantized cache cannot reproduce the model dtype's logprobs exactly


def _bench():
    spec = importlib.util.spec_from_file_location("kv_quant_quality", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kv_quant_quality"] = mod
    spec.loader.exec_module(mod)
    return mod


def violations(kv: str, m: dict) -> list[str]:
    mean_max, max_max, agree_min = BOUNDS[kv]
    out = []
    if not MIN_MEAN_DIFF <= m["logprob_abs_diff_mean"] <= mean_max:
        out.append(f"mean |dlogprob| {m['logprob_abs_diff_mean']} outside [{MIN_MEAN_DIFF}, {mean_max}]")
    if m["logprob_abs_diff_max"] > max_max:
        out.append(f"max |dlogprob| {m['logprob_abs_diff_max']} > {max_max}")
    if m["prefix_agreement"] < agree_min:
        out.append(f"prefix agreement {m['prefix_agreement']} < {agree_min}")
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    bench = _bench()
    path = bench.tiny_model_path("tiny-llama", tmp_path_factory.mktemp("calm"), weight_scale=6.0)
    tok = Tokenizer.load(Path(path))
    prompts = [tok.encode(p) for p in bench.PROMPTS]
    weights = load_model_source(path)
    run = lambda kv, **kw: bench.greedy(weights, path, kv, prompts, 24, num_blocks=64,  # noqa: E731
                                        max_model_len=128, **kw)
    return bench, run, run("auto")


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_quantized_runs_stay_within_the_benchmark_bounds(setup, kv):
    bench, run, ref = setup
    m = bench.compare(ref, run(kv))
    assert violations(kv, m) == [], m


def test_an_unquantized_run_fails_the_bounds(setup):
    bench, run, ref = setup
    m = bench.compare(ref, run("auto"))
    assert any("mean |dlogprob|" in v for v in violations("int8", m))


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_corrupted_scales_fail_the_bounds(setup, kv):
    """Scale every stored token's scales by 1.25 once the prompts are in the pool."""
    bench, run, ref = setup
    done = []

    def corrupt(engine):
        if done:
            return
        pool = engine.runner.kv_pool
        pool.tensor[..., pool.block_size * pool.model_config.head_dim:].view(SCALE_DTYPE).mul_(1.25)
        done.append(True)

    m = bench.compare(ref, run(kv, after_step=corrupt))
    assert violations(kv, m), m

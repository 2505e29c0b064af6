"""A layer's token-wise work over row slices (LlamaForCausalLM.row_chunk) against transformers."""
from __future__ import annotations

import random

import pytest
import torch

from _runner_helpers import hf_logits, make_runner, request, sched_seq, step, step_all_positions
from tiny_models import load_hf_model


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("row_chunk", [1, 5, 8])
def test_sliced_rows_match_hf_and_unsliced(arch, row_chunk, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    hf = load_hf_model(model_dir)
    runs = {}
    for chunk in (0, row_chunk):
        runner = make_runner(model_dir, block_size=4)
        runner.model.row_chunk = chunk
        a = request("a", _prompt(19, runner.vocab_size, 30))
        b = request("b", _prompt(7, runner.vocab_size, 31))
        step(runner, [sched_seq(a, 8, [4, 9, 1, 7, 12])])            # a's first 8 tokens cached
        outs = step_all_positions(runner, [sched_seq(b, 7, [20, 21]), sched_seq(a, 11, [4, 9, 1, 7, 12])])
        torch.testing.assert_close(outs[0], hf_logits(hf, b.all_token_ids), atol=1e-4, rtol=0)
        torch.testing.assert_close(outs[1], hf_logits(hf, a.all_token_ids)[8:], atol=1e-4, rtol=0)
        runs[chunk] = torch.cat(outs)
    torch.testing.assert_close(runs[row_chunk], runs[0], atol=1e-5, rtol=0)


def test_default_row_chunk_is_on(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    assert runner.model.row_chunk > 0

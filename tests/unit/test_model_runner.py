"""ModelRunner edge cases: empty steps, chunks without sampling, input validation, bf16."""
from __future__ import annotations

import pytest
import torch

from _runner_helpers import hf_logits, make_runner, request, sched_seq, step
from engine.scheduler_output import ScheduledSeq, SchedulerOutput
from tiny_models import load_hf_model


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    return make_runner(tiny_llama_dir, block_size=4, num_blocks=32, max_model_len=64)


def test_empty_step_and_unsampled_chunk_return_no_rows(runner):
    assert runner.execute(SchedulerOutput()).shape == (0, runner.vocab_size)
    req = request("x", list(range(3, 13)))
    out = step(runner, [sched_seq(req, 6, [1, 2, 3])])           # chunk ends before the prompt does
    assert out.shape == (0, runner.vocab_size) and req.num_computed_tokens == 6


def test_logits_follow_sched_order_not_batch_order(runner, tiny_llama_dir):
    hf = load_hf_model(tiny_llama_dir)
    a, b = request("a", [5, 6, 7, 8, 9]), request("b", [11, 12, 13])
    step(runner, [sched_seq(a, 5, [4, 5])])
    a.append_output_token(20)
    # decode first in sched order, prefill second: the runner reorders internally
    out = step(runner, [sched_seq(a, 1, [4, 5]), sched_seq(b, 3, [6])])
    torch.testing.assert_close(out[0], hf_logits(hf, a.all_token_ids)[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(hf, b.all_token_ids)[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("prompt_len,n,blocks,match", [
    (9, 9, [1, 2], "blocks cannot hold"),                     # 2 blocks of 4 < 9 tokens
    (70, 70, list(range(1, 19)), "max_model_len"),            # 70 > max_model_len=64
    (10, 11, [1, 2, 3], "cannot compute"),                    # more tokens than the request has
])
def test_invalid_schedules_raise(runner, prompt_len, n, blocks, match):
    req = request("bad", [3] * prompt_len)
    with pytest.raises(ValueError, match=match):
        runner.execute(SchedulerOutput([ScheduledSeq(req, n, blocks, True)]))


def test_bfloat16_runner_tracks_fp32(tiny_llama_dir):
    fp32 = make_runner(tiny_llama_dir, dtype="float32")
    bf16 = make_runner(tiny_llama_dir, dtype="bfloat16")
    assert bf16.kv_pool.tensor.dtype == torch.bfloat16
    prompt = [7, 99, 23, 150, 42, 8, 61, 77, 5]
    outs = []
    for r in (fp32, bf16):
        req = request("p", prompt)
        logits = step(r, [sched_seq(req, len(prompt), [3, 4, 5])])
        assert logits.dtype == torch.float32
        outs.append(logits[0])
    assert int(outs[0].argmax()) == int(outs[1].argmax())
    assert (outs[0] - outs[1]).abs().max() < 0.05 * outs[0].abs().max()

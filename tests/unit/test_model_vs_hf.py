"""Our paged model against transformers on the same tiny random weights."""
from __future__ import annotations

import random

import pytest
import torch

from _runner_helpers import hf_logits, make_runner, request, sched_seq, step, step_all_positions
from tiny_models import load_hf_model, make_tiny_model

ATOL = 1e-4


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    # logits here are O(10); fp32 batched-vs-unbatched differences are ~2e-5
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)




@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tiny_llama_dir, tiny_qwen2_dir):
    d = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    return d, load_hf_model(d)


def test_full_prefill_matches_hf(pair):
    model_dir, hf = pair
    runner = make_runner(model_dir)
    prompt = _prompt(21, runner.vocab_size, 1)
    ref = hf_logits(hf, prompt)
    req = request("a", prompt)
    (ours,) = step_all_positions(runner, [sched_seq(req, len(prompt), list(range(10, 16)))])
    _close(ours, ref)
    # the runner's own output: last-token logits only, float32
    req2 = request("b", prompt)
    last = step(runner, [sched_seq(req2, len(prompt), list(range(20, 26)))])
    assert last.shape == (1, runner.vocab_size) and last.dtype == torch.float32
    _close(last[0], ref[-1])


def test_chunked_prefill_then_decode_matches_hf_at_every_position(pair):
    model_dir, hf = pair
    runner = make_runner(model_dir, block_size=4)
    prompt = _prompt(23, runner.vocab_size, 2)
    blocks = [17, 3, 40, 8, 25, 11, 60, 2, 33, 5]          # non-contiguous, room for 40 tokens
    req = request("c", prompt)
    got: list[torch.Tensor] = []
    for n in (5, 7, 6, 5):                                  # not multiples of the block size
        (chunk,) = step_all_positions(runner, [sched_seq(req, n, blocks)])
        got.append(chunk)
    assert req.num_computed_tokens == len(prompt)
    for _ in range(12):                                     # decode through the block table
        req.append_output_token(int(got[-1][-1].argmax()))
        logits = step(runner, [sched_seq(req, 1, blocks)])
        got.append(logits)
    ref = hf_logits(hf, req.all_token_ids)
    _close(torch.cat(got), ref[:req.num_computed_tokens])


def test_mixed_batch_prefills_and_shuffled_decodes(pair):
    model_dir, hf = pair
    runner = make_runner(model_dir, block_size=4, num_blocks=96)
    free = list(range(1, 96))
    random.Random(3).shuffle(free)

    def take(n):
        return [free.pop() for _ in range(n)]

    decodes = [request(f"d{i}", _prompt(ln, runner.vocab_size, 10 + i)) for i, ln in enumerate((9, 14, 5))]
    tables = {r.request_id: take(6) for r in decodes}
    for r in decodes:                                        # bring them to decode state
        first = step(runner, [sched_seq(r, r.num_prompt_tokens, tables[r.request_id])])
        r.append_output_token(int(first[0].argmax()))
    p1 = request("p1", _prompt(13, runner.vocab_size, 20))
    p2 = request("p2", _prompt(6, runner.vocab_size, 21))
    tables["p1"], tables["p2"] = take(5), take(3)
    order = [decodes[0], p1, decodes[2], p2, decodes[1]]     # interleaved on purpose
    seqs = [sched_seq(r, 1 if r in decodes else r.num_prompt_tokens, tables[r.request_id]) for r in order]
    logits = step(runner, seqs)
    assert logits.shape == (5, runner.vocab_size)
    for row, r in zip(logits, order):
        _close(row, hf_logits(hf, r.all_token_ids)[-1])


def test_prefill_with_cached_prefix_batched_with_fresh_prompt(pair):
    model_dir, hf = pair
    runner = make_runner(model_dir, block_size=4)
    a = request("a", _prompt(19, runner.vocab_size, 30))
    b = request("b", _prompt(7, runner.vocab_size, 31))
    step(runner, [sched_seq(a, 8, [4, 9, 1, 7, 12])])       # a's first 8 tokens cached
    outs = step_all_positions(runner, [sched_seq(b, 7, [20, 21]), sched_seq(a, 11, [4, 9, 1, 7, 12])])
    _close(outs[0], hf_logits(hf, b.all_token_ids))
    _close(outs[1], hf_logits(hf, a.all_token_ids)[8:])


def test_copy_on_write_block_copies(tiny_llama_dir):
    hf = load_hf_model(tiny_llama_dir)
    runner = make_runner(tiny_llama_dir, block_size=4)
    parent = request("parent", _prompt(10, runner.vocab_size, 40))   # blocks 5, 6 full; 7 half
    step(runner, [sched_seq(parent, 10, [5, 6, 7])])
    child = request("child", parent.prompt_token_ids)
    child.num_computed_tokens = 10
    child.append_output_token(11)
    # the child shares the full blocks and gets a private copy of the partial one
    logits = step(runner, [sched_seq(child, 1, [5, 6, 30])], copies=[(7, 30)])
    pool = runner.kv_pool.tensor
    # copied block: the parent's two tokens in slots 0-1, the child's new token in slot 2
    torch.testing.assert_close(pool[30][..., :2, :], pool[7][..., :2, :])
    assert not torch.equal(pool[30][..., 2, :], pool[7][..., 2, :])
    _close(logits[0], hf_logits(hf, child.all_token_ids)[-1])


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "linear", "factor": 4.0},
])
def test_rope_scaling_matches_hf(tmp_path, scaling):
    model_dir = make_tiny_model(tmp_path / "m", "llama", rope_scaling=scaling)
    hf = load_hf_model(model_dir)
    runner = make_runner(model_dir, block_size=8)
    prompt = _prompt(40, runner.vocab_size, 50)
    req = request("r", prompt)
    (ours,) = step_all_positions(runner, [sched_seq(req, 40, list(range(1, 7)))])
    _close(ours, hf_logits(hf, prompt))

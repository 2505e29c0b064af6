"""Layer-wise hand-off of the last prefill chunk: the engine's layer progress
(reported only once a layer group's K/V are in the pool), the layer byte ranges of a
block, and the decode side's bookkeeping per (block, layer range): what a submit
still reads after the reads ahead, and that nothing stale or missing is trusted."""
from __future__ import annotations

import pytest
import torch

from decode_worker.read_ahead import AheadRead, RestRead, plan_rest
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.layer_progress import layer_marks
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kvtransfer.layout import KVPoolLayout

SRC = ("prefill-0", "inc-1")
L = 30


def test_layer_marks_split_the_layers_evenly_with_the_last_group_no_larger():
    assert layer_marks(30, 4) == (8, 15, 23)          # groups of 8, 7, 8, 7
    assert layer_marks(3, 4) == (1, 2)                # at most one group per layer
    assert layer_marks(30, 1) == ()
    with pytest.raises(ValueError, match="groups must be >= 1"):
        layer_marks(30, 0)


def test_a_layer_range_is_one_byte_range_of_every_block():
    pool = torch.zeros(4, 3, 2, 2, 16, 8)              # [blocks, layers, K|V, heads, block, head_dim]
    layout = KVPoolLayout.from_tensor(pool)
    per_layer = 2 * 2 * 16 * 8 * 4
    assert layout.layer_range(3, 1, 3) == (per_layer, 2 * per_layer)
    flat = pool.view(4, -1)
    pool[2, 1] = 1.0                                   # layer 1 of block 2: exactly those bytes
    off, n = layout.layer_range(3, 1, 2)
    assert flat[2, off // 4:(off + n) // 4].eq(1).all() and flat[2].sum() == n // 4
    with pytest.raises(ValueError, match="non-empty range"):
        layout.layer_range(3, 2, 2)
    with pytest.raises(ValueError, match="does not split into 7 layers"):
        layout.layer_range(7, 0, 1)


def _whole(indices, src, preemptions=0, source=SRC):
    return AheadRead(source=source, indices=tuple(indices), src=tuple(src), preemptions=preemptions)


def _layers(indices, src, layers, preemptions=0, source=SRC):
    return AheadRead(source=source, indices=tuple(indices), src=tuple(src), preemptions=preemptions, layers=layers)


def _plan(done, src_blocks, first=0, preemptions=0, end=None):
    return plan_rest(done, source=SRC, preemptions=preemptions, src_blocks=src_blocks, first=first,
                     end=len(src_blocks) if end is None else end, num_layers=L)


def test_the_submit_reads_only_the_last_layer_group_of_the_last_chunk():
    src = [40, 41, 42, 43, 50, 51]                     # blocks 0-3 read whole ahead, 4-5: the last chunk
    done = [_whole(range(4), src[:4]), _layers([4, 5], [50, 51], (0, 8)), _layers([4, 5], [50, 51], (8, 15)),
            _layers([4, 5], [50, 51], (15, 23))]
    plan = _plan(done, src)
    assert plan.reads == (RestRead(((23, 30),), (4, 5)),)
    assert (plan.ahead_blocks, plan.layer_blocks, plan.blocks) == (4, 2, 6)
    assert plan.ahead_layers == 4 * L + 2 * 23


def test_a_skipped_layer_group_is_read_at_the_submit_not_trusted():
    src = [50, 51]
    done = [_layers([0, 1], src, (0, 8)), _layers([0, 1], src, (15, 23))]   # (8, 15) never arrived
    plan = _plan(done, src)
    assert plan.reads == (RestRead(((8, 15), (23, 30)), (0, 1)),)
    assert plan.ahead_blocks == 0 and plan.ahead_layers == 2 * 16


def test_stale_layer_reads_count_for_nothing():
    """Read from another source, at another preemption count, or from another block
    than the handle names: that block's layers are read again, whole."""
    src = [50, 51, 52]
    done = [_layers([0, 1, 2], [50, 51, 99], (0, 15)),                    # block 2 came from block 99
            _layers([0, 1, 2], src, (15, 29), preemptions=1),              # before a preemption
            _layers([0, 1, 2], src, (15, 29), source=("prefill-1", "x")),  # the prefill retried elsewhere
            _layers([0, 1], src[:2], (15, 30))]
    plan = _plan(done, src)
    assert plan.reads == (RestRead(((0, L),), (2,)),)                     # whole blocks first
    assert plan.ahead_blocks == 2 and plan.layer_blocks == 0
    assert _plan(done, src, preemptions=1).reads == (RestRead(((0, 15), (29, 30)), (0, 1, 2)),)


def test_everything_read_ahead_still_reads_the_last_block_for_the_notification():
    src = [7, 8]
    plan = _plan([_whole([0], [7]), _layers([1], [8], (0, 20)), _layers([1], [8], (20, 30))], src)
    assert plan.reads == (RestRead(((0, L),), (1,)),)
    assert plan.ahead_blocks == 1 and plan.ahead_layers == L
    assert _plan([], src, first=2).reads == ()          # all cached: nothing to read


def test_cached_blocks_are_neither_read_nor_counted():
    src = [7, 8, 9]
    plan = _plan([_layers([0, 1, 2], src, (0, 10))], src, first=1)
    assert plan.reads == (RestRead(((10, L),), (1, 2)),) and plan.ahead_layers == 2 * 10


def test_the_step_completing_a_prompt_reports_each_layer_group_once_its_kv_is_in(tiny_llama_dir):
    """Tiny Llama: 3 layers, groups of one layer. At each report the reported layers of
    the prompt's blocks already hold their final bytes and the later layers do not yet."""
    e = LLMEngine(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=32),
                               scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32,
                                                         max_model_len=256), prompt_layer_groups=4))
    pool = e.kv_pool.tensor
    seen = []

    def early(deltas):
        for d in deltas:
            blocks = list(d.computed_block_ids)
            seen.append((d.computed_layers, blocks, d.preemptions, pool[blocks].clone()))

    e.add_request("p", list(range(5, 75)), SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
    e.add_request("plain", list(range(9, 29)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    steps = []
    while e.has_unfinished():
        steps.append(e.step(early))
    token = [d for s in steps for d in s if d.new_token_ids and d.request_id == "p"]
    assert len(token) == 1                              # 70 tokens: chunks of 32, 32, 6
    held = list(token[0].held_block_ids)
    assert [(n, b, p) for n, b, p, _ in seen] == [(1, held, 0), (2, held, 0)], "one report per group but the last"
    final = pool[held]
    for n, _, _, snap in seen:
        assert torch.equal(snap[:, :n], final[:, :n]), f"layers [0, {n}) were reported before they were written"
        assert not torch.equal(snap[:, n:], final[:, n:]), f"layers past {n} were already written: reported late"

"""The engine's prefill role: a prefill_only request finishes at its first token
and holds its blocks for a reader."""
from __future__ import annotations

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def _engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                                  scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                            max_model_len=256)))


def test_a_prefill_only_finish_carries_its_held_blocks(tiny_llama_dir):
    """The prefill role hands the held block ids out with the first token, so the
    prefill worker need not wait for the engine's next step boundary to ask."""
    e = _engine(tiny_llama_dir)
    e.add_request("p", list(range(5, 45)), SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
    deltas = []
    while e.has_unfinished():
        deltas += e.step()
    [d] = deltas
    assert d.finish_reason and len(d.held_block_ids) == 3            # 40 tokens in blocks of 16
    assert list(d.held_block_ids) == e.held_block_ids("p")
    assert e.release_held("p") and e.stats().kv_blocks_used == 0


def test_abort_unstarted_takes_back_only_queued_single_sample_requests(tiny_llama_dir):
    """What a draining worker hands elsewhere: requests still waiting with nothing
    computed and n == 1. A running one, and an n > 1 one, stay."""
    e = LLMEngine(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                               scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=256)))
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    e.add_request("running", [5, 6, 7], p)
    e.step()                                          # "running" is scheduled (max_num_seqs 1)
    e.add_request("queued-1", [5, 6, 8], p)
    e.add_request("fan-out", [5, 6, 9], SamplingParams(max_tokens=4, n=2))
    e.add_request("queued-2", [5, 6, 10], p)
    assert e.abort_unstarted() == ["queued-1", "queued-2"]
    assert e.stats().waiting == 1 and e.stats().running == 1
    assert e.abort_unstarted() == []
    e.check_integrity()

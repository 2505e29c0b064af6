"""SchedulerConfig.max_waiting: the engine refuses a request beyond its queue
bound at once (QueueFull), changing nothing, and takes it once there is room."""
from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine, QueueFull
from engine.sampling_params import SamplingParams


@pytest.fixture
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                                  scheduler=SchedulerConfig(max_num_seqs=1, max_waiting=2, max_model_len=256)))


def test_full_queue_refuses_without_side_effects_then_admits(engine):
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], p)
    engine.add_request("b", [5, 6, 8], p)
    with pytest.raises(QueueFull, match="max_waiting 2"):
        engine.add_request("c", [5, 6, 9], p)
    assert engine.stats().waiting == 2
    engine.add_request("c", [5, 6, 9], p, bounded=False)      # already accepted elsewhere: not refused
    assert engine.stats().waiting == 3
    engine.abort_request("c")
    engine.step()                                               # "a" runs (max_num_seqs 1): room for one
    assert engine.stats().waiting == 1
    engine.add_request("d", [5, 6, 10], p)
    with pytest.raises(QueueFull):
        engine.check_room(elsewhere=0)
    engine.check_integrity()


def test_no_bound_by_default_and_bad_bound_rejected(tiny_llama_dir):
    e = LLMEngine(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                               scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=256)))
    for i in range(50):
        e.add_request(f"r{i}", [5, 6, i + 7], SamplingParams(max_tokens=1))
    assert e.stats().waiting == 50
    with pytest.raises(ValueError, match="max_waiting"):
        SchedulerConfig(max_waiting=-1)


def test_give_back_aborts_only_the_named_requests_not_started(engine):
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for rid, last in (("a", 7), ("b", 8), ("c", 9)):
        engine.add_request(rid, [5, 6, last], p, bounded=False)
    engine.step()                                               # "a" runs (max_num_seqs 1)
    assert engine.give_back(["a", "c", "unknown"]) == ["c"]     # "a" started; "b" not named
    assert engine.stats().waiting == 1 and engine.stats().running == 1
    engine.check_integrity()

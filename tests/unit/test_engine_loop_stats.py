"""EngineLoop publishes its stats right after adding requests, not only after the
step that computes them: a router reading the stats while a long prefill step runs
sees the queue (before, a prefill worker looked idle to it for the whole step)."""
from __future__ import annotations

import threading

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def test_stats_count_a_request_added_before_the_step_that_computes_it_ends(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                                    scheduler=SchedulerConfig(max_model_len=256)))
    release, stepping = threading.Event(), threading.Event()
    step = engine.step

    def slow_step(on_admitted=None):
        stepping.set()
        release.wait(10)
        return step(on_admitted)

    engine.step = slow_step                       # type: ignore[method-assign]
    loop = EngineLoop(engine, on_deltas=lambda deltas: None).start()
    try:
        loop.call(lambda e: e.add_request("a", list(range(5, 105)), SamplingParams(max_tokens=1))).result(10)
        assert stepping.wait(10)
        stats, _ = loop.snapshot()                # the step is running, not done
        assert stats.waiting == 1 and stats.waiting_tokens == 100
        release.set()
    finally:
        release.set()
        loop.stop()

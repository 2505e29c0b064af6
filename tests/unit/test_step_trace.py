"""The engine loop's step trace (engine/step_trace.py): one record per step that
computed tokens, with the step's real shape, wall and CPU time; off by default."""
from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.step_trace import StepRecord, StepShape, StepTrace


def _engine(model_dir, trace: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                                  scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                            max_model_len=256),
                                  step_trace_size=trace))


async def _generate(ae: AsyncEngine, prompts: dict[str, list[int]], max_tokens: int) -> None:
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    queues = {rid: ae.subscribe(rid) for rid in prompts}
    for rid, prompt in prompts.items():
        await ae.call(lambda e, rid=rid, prompt=prompt: e.add_request(rid, prompt, p))
    for q in queues.values():
        while not (await q.get()).finish_reason:
            pass


def test_records_every_step_with_its_shape_and_times(tiny_llama_dir):
    ae = AsyncEngine(_engine(tiny_llama_dir, 1000))

    async def go():
        await _generate(ae, {"a": list(range(5, 85)), "b": list(range(7, 27))}, max_tokens=4)
        await ae.call(lambda e: None)     # the last step's record is appended after its outputs go out
        return ae.step_trace()

    got = asyncio.run(go())
    ae.stop()
    assert got["enabled"] and got["dropped"] == 0
    recs = [StepRecord.from_json(r) for r in got["records"]]
    # 80 + 20 prompt tokens at 64 per step, then decodes: every token computed once
    assert sum(r.shape.tokens for r in recs) == 80 + 20 + 2 * 3
    assert recs[0].shape.chunks == ((64, 0),) and recs[0].shape.decode_ctx == ()
    decodes = [r for r in recs if r.shape.decode_ctx and not r.shape.chunks]
    assert decodes and all(len(r.shape.decode_ctx) <= 2 for r in decodes)
    assert max(c for r in decodes for c in r.shape.decode_ctx) == 80 + 4 - 1
    for r in recs:
        assert r.wall_s > 0 and 0 <= r.cpu_s and r.emit_s >= 0 and r.gap_s >= 0
        assert r.start_unix > 1.6e9
    assert [r.start_unix for r in recs] == sorted(r.start_unix for r in recs)
    assert ae.step_trace()["records"] == []                   # drained


def test_off_by_default_and_bounded(tiny_llama_dir):
    ae = AsyncEngine(_engine(tiny_llama_dir, 0))
    assert ae.step_trace() == {"enabled": False, "records": [], "dropped": 0}
    ae.stop()
    ring = StepTrace(2)
    rec = StepRecord(1.0, 0.1, 0.1, 0.0, 0.0, StepShape(((3, 0),), ()))
    for _ in range(5):
        ring.append(rec)
    assert ring.drain() == [rec, rec] and ring.dropped == 3 and ring.recorded == 5
    assert StepRecord.from_json(rec.to_json()) == rec


def test_bad_sizes_are_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="step_trace_size must be >= 0"):
        _engine(tiny_llama_dir, -1)
    with pytest.raises(ValueError, match=">= 1 record"):
        StepTrace(0)


"""A hand-off that finds no room on its decode node waits there, and that wait
is visible: the node's report counts it as a waiting request (the router's
load and the waiting-requests gauge see it), a drain gives it back `moved`
with nothing joined, and the count returns to zero. Real prefill and decode
workers in one process, KV over the tcp transfer engine (no Ray)."""
from __future__ import annotations

import asyncio

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from kvtransfer.settings import TransferSettings
from worker_api.messages import WorkItem


@pytest.fixture(scope="module")
def workers(tiny_llama_dir):
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    def cfg(max_num_seqs: int) -> EngineConfig:
        return EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=160),
                            scheduler=SchedulerConfig(max_model_len=2048, max_num_seqs=max_num_seqs))

    settings = TransferSettings(backend="tcp", lease_ttl=60.0, timeout=60.0)
    return PrefillWorker("prefill-r", cfg(4), settings), DecodeWorker("decode-r", cfg(1), settings)


def test_a_hand_off_waiting_for_room_is_reported_waiting_and_drains_moved(workers):
    pw, dw = workers
    long = SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True)   # holds the only slot

    async def waiting() -> int:
        return (await dw.report()).stats.waiting

    async def go():
        a_prompt, b_prompt = list(range(3, 43)), list(range(60, 100))
        a_item = WorkItem(request_id="a", prompt_token_ids=tuple(a_prompt), sampling=long)
        b_item = WorkItem(request_id="b", prompt_token_ids=tuple(b_prompt), sampling=long)
        a = await pw.prefill(item=a_item)
        joined = await dw.submit(item=a_item, handle=a.handle, first_token=a.first_token)
        assert joined.joined and not joined.moved, joined
        assert await waiting() == 0
        b = await pw.prefill(item=b_item)
        pending = asyncio.ensure_future(dw.submit(item=b_item, handle=b.handle, first_token=b.first_token))
        seen = 0
        for _ in range(2000):           # "a" decodes ~1900 steps: "b" finds no slot meanwhile
            seen = await waiting()
            if seen or pending.done():
                break
            await asyncio.sleep(0.005)
        moved = await dw.drain()
        result = await pending
        after = await waiting()
        dw.undrain()
        await dw.abort(request_id="a")
        await pw.release(request_id="b")
        return seen, moved, result, after

    seen, moved, result, after = asyncio.run(go())
    assert seen == 1, "the hand-off waiting for KV room was not reported as waiting"
    assert moved == [], "nothing was queued in the engine itself"
    assert result.moved and not result.joined and result.error == "draining", result
    assert after == 0

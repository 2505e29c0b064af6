"""A hand-off that finds no room on its decode node waits there, and that wait
is visible: the node's report counts it as a waiting request (the router's
load and the waiting-requests gauge see it), a drain gives it back `moved`
with nothing joined, and the count returns to zero. Real prefill and decode
workers in one process, KV over the tcp transfer engine (no Ray). Given back instead (a decode
pool rebalancing toward free slots), its submit returns `moved` + `given_back` and the same KV
handle joins later."""
from __future__ import annotations

import asyncio

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from kvtransfer.settings import TransferSettings
from worker_api.messages import GiveBack, WorkItem


def make_workers(model_dir, name: str):
    """A prefill worker and a decode worker with one batch slot (each test its own: a worker's
    async parts belong to the event loop it started in)."""
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    def cfg(max_num_seqs: int) -> EngineConfig:
        return EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=16, num_blocks=160),
                            scheduler=SchedulerConfig(max_model_len=2048, max_num_seqs=max_num_seqs))

    settings = TransferSettings(backend="tcp", lease_ttl=60.0, timeout=60.0)
    return PrefillWorker(f"prefill-{name}", cfg(4), settings), DecodeWorker(f"decode-{name}", cfg(1), settings)


@pytest.fixture(scope="module")
def workers(tiny_llama_dir):
    return make_workers(tiny_llama_dir, "r")


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


def test_a_hand_off_waiting_for_room_is_given_back_and_joins_later_with_its_handle(tiny_llama_dir):
    pw, dw = make_workers(tiny_llama_dir, "g")
    long = SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True)   # holds the only slot

    async def go():
        a_item = WorkItem(request_id="ga", prompt_token_ids=tuple(range(3, 43)), sampling=long)
        b_item = WorkItem(request_id="gb", prompt_token_ids=tuple(range(60, 100)), sampling=long)
        a = await pw.prefill(item=a_item)
        assert (await dw.submit(item=a_item, handle=a.handle, first_token=a.first_token)).joined
        b = await pw.prefill(item=b_item)
        assert await dw.give_back(request_ids=["gb"]) == GiveBack()   # not waiting here yet
        pending = asyncio.ensure_future(dw.submit(item=b_item, handle=b.handle, first_token=b.first_token))
        for _ in range(2000):
            if (await dw.report()).stats.waiting or pending.done():
                break
            await asyncio.sleep(0.005)
        given = await dw.give_back(request_ids=["ga", "gb", "unknown"])   # "ga" runs: it stays
        result = await pending
        waiting_after = (await dw.report()).stats.waiting
        await dw.abort(request_id="ga")                                    # room now: the same handle joins
        again = await dw.submit(item=b_item, handle=b.handle, first_token=b.first_token)
        await dw.abort(request_id="gb")
        return given, result, waiting_after, again

    given, result, waiting_after, again = asyncio.run(go())
    assert given == GiveBack(waiting_for_room=("gb",), queued=())
    assert result.moved and result.given_back and not result.joined and not result.busy, result
    assert waiting_after == 0
    assert again.joined and not again.moved and again.transferred_blocks > 0, again

"""The worker API (worker_api/): both workers implement their protocol with
keyword-only remote methods, the Ray-handle view lists the same methods, the
values that cross the boundary check what they are given, and a prefill reports
real timings. In-process workers over the tcp transfer engine (no Ray)."""
from __future__ import annotations

import asyncio
import inspect

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.sampling_params import SamplingParams
from kvtransfer.settings import TransferSettings
from worker_api import protocol
from worker_api.messages import PrefillResult, WorkItem

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _methods(proto: type) -> dict[str, inspect.Signature]:
    names = {n for cls in proto.__mro__ if cls.__module__ == protocol.__name__
             for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
    return {n: inspect.signature(getattr(proto, n)) for n in names}


def _fields(handle: type) -> set[str]:
    return {n for cls in handle.__mro__ if cls.__module__ == protocol.__name__
            for n in getattr(cls, "__annotations__", {})}


@pytest.mark.parametrize("api, handle", [(protocol.PrefillWorkerAPI, protocol.PrefillWorkerHandle),
                                         (protocol.DecodeWorkerAPI, protocol.DecodeWorkerHandle)])
def test_every_remote_method_takes_keywords_only_and_the_handle_lists_them_all(api, handle):
    methods = _methods(api)
    assert {"ready", "report", "step_trace", "kv_snapshot", "check_integrity", "drain", "undrain",
            "abort"} <= set(methods)
    for name, sig in methods.items():
        params = [p for p in sig.parameters.values() if p.name != "self"]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), f"{name}{sig}"
    assert _fields(handle) == set(methods)


def test_the_workers_implement_their_protocol_with_the_same_signatures():
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    for cls, api in ((PrefillWorker, protocol.PrefillWorkerAPI), (DecodeWorker, protocol.DecodeWorkerAPI)):
        for name, sig in _methods(api).items():
            got = inspect.signature(getattr(cls, name))
            # ray.remote(cls) adds a `_ray_trace_ctx` keyword to the class's methods, in place
            params = [p for p in got.parameters.values() if not p.name.startswith("_ray_")]
            assert [p.name for p in params] == list(sig.parameters), f"{cls.__name__}.{name}{got} != {sig}"
            assert [p.kind for p in params] == [p.kind for p in sig.parameters.values()]
        public = {n for n in vars(cls) if not n.startswith("_") and callable(getattr(cls, n))}
        assert public <= set(_methods(api)), f"{cls.__name__} has methods the protocol does not state"


def test_a_work_item_wants_a_tuple_and_a_result_names_its_first_token():
    with pytest.raises(ValueError, match="tuple"):
        WorkItem(request_id="r", prompt_token_ids=[1, 2, 3], sampling=GREEDY)  # type: ignore[arg-type]
    assert PrefillResult(first=None, moved=True).first_token is None


@pytest.fixture
def workers(tiny_llama_dir):
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    cfg = EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                       scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=256))
    settings = TransferSettings(backend="tcp", lease_ttl=60.0, timeout=60.0)
    return PrefillWorker("prefill-api", cfg, settings), DecodeWorker("decode-api", cfg, settings)


def test_a_prefill_reports_its_queue_time_and_a_hand_off_needs_the_first_token(workers):
    pw, dw = workers

    async def go():
        items = [WorkItem(request_id=f"r{i}", prompt_token_ids=tuple(range(5 + i, 45 + i)), sampling=GREEDY)
                 for i in range(3)]
        results = await asyncio.gather(*(pw.prefill(item=it) for it in items))   # one at a time (max_num_seqs 1)
        with pytest.raises(ValueError, match="first_token"):
            await dw.submit(item=items[0], handle=results[0].handle)
        with pytest.raises(ValueError, match="PullFailure"):
            await dw.submit(item=items[0], handle=results[0].handle, first_token=results[0].first_token,
                            on_pull_failure="report")  # type: ignore[arg-type]
        for it in items:
            assert await pw.release(request_id=it.request_id)
        return results, await pw.check_integrity()

    results, state = asyncio.run(go())
    for r in results:
        assert r.first_token is not None and r.handle is not None and r.first_token == r.first.new_token_ids[0]
        assert r.queue_seconds is not None and 0 <= r.queue_seconds <= r.prefill_seconds
    # the later ones waited in the queue while the first one was prefilled
    assert max(r.queue_seconds for r in results) > 0
    assert state.kv_blocks_used == 0 and state.leases == 0

"""The request runner's shared pieces, with a fake backend: the one deadline (client's or
request_timeout, whichever first), the typed pump messages (a failure re-raised, an early
end refused), and in-flight tracking with idle waiting (what both frontends' drain uses)."""
from __future__ import annotations

import asyncio

import pytest

from cluster.frontends.admission import AdmissionController
from cluster.frontends.pump import Delta, End, Failed, Pump
from cluster.frontends.runner import RequestRunner
from cluster.frontends.validation import GenerateInput, Limits, SamplingInput
from cluster.observability.metrics import Metrics
from cluster.orchestration.backend import BackendError
from engine.outputs import StepDelta


class _Backend:
    def __init__(self, deltas=(), error: Exception | None = None, stall: bool = False) -> None:
        self.deltas, self.error, self.stall = deltas, error, stall
        self.aborted: list[str] = []

    def tokenizer(self):
        return None

    async def generate(self, job):
        for d in self.deltas:
            yield StepDelta(job.request_id, *d[:1], **d[1])
        if self.error is not None:
            raise self.error
        if self.stall:
            await asyncio.Event().wait()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _runner(backend, **kw) -> RequestRunner:
    return RequestRunner(backend, Metrics(), Limits(max_model_len=64, block_size=16, vocab_size=100),
                         AdmissionController(4, 10_000), **kw)


async def _collect(runner: RequestRunner, **kw) -> list:
    inp = GenerateInput(request_id="r", prompt_token_ids=(1, 2, 3), sampling=SamplingInput(max_tokens=4))
    return [c async for c in runner.run(inp, **kw)]


def test_the_deadline_is_the_clients_or_request_timeout_whichever_comes_first():
    r = _runner(_Backend(), request_timeout=10.0)
    assert r.deadline(None, 100.0) == 110.0
    assert r.deadline(105.0, 100.0) == 105.0 and r.deadline(200.0, 100.0) == 110.0
    assert _runner(_Backend()).deadline(None, 100.0) is None      # 0 = no server deadline
    with pytest.raises(ValueError, match="request_timeout must be >= 0"):
        _runner(_Backend(), request_timeout=-1.0)


def test_request_timeout_ends_a_stalled_request_deadline_exceeded_and_aborts_it():
    backend = _Backend(stall=True)
    runner = _runner(backend, request_timeout=0.2)

    async def go():
        try:
            await _collect(runner)
        finally:
            await runner.wait_cleanups(5)      # the abort runs in the background

    with pytest.raises(BackendError) as ei:
        asyncio.run(go())
    assert ei.value.code == "DEADLINE_EXCEEDED" and "request_timeout" in ei.value.message
    assert backend.aborted == ["r"] and runner.admission.in_flight == 0


def test_a_backend_failure_reaches_the_consumer_and_an_early_end_is_unavailable():
    boom = BackendError("UNAVAILABLE", "no decode worker")
    with pytest.raises(BackendError) as ei:
        asyncio.run(_collect(_runner(_Backend(deltas=[((5,), {})], error=boom))))
    assert ei.value is boom
    with pytest.raises(BackendError, match="ended the stream before finishing 1 of 1"):
        asyncio.run(_collect(_runner(_Backend(deltas=[((5,), {})]))))
    done = asyncio.run(_collect(_runner(_Backend(deltas=[((5,), {}), ((6,), {"finish_reason": "length"})]))))
    assert [c.token_ids for c in done] == [(5,), (6,)] and done[-1].finish_reason == "length"


def test_pump_messages_are_typed_and_replace_with_drops_the_backlog():
    async def go():
        pump = Pump(consumer_timeout=0.0, depth=4)

        async def deltas():
            yield StepDelta("r", (5,))

        assert await pump.drain(deltas)
        first, last = await pump.get(1.0), await pump.get(1.0)
        assert isinstance(first, Delta) and first.delta.new_token_ids == (5,) and last == End()
        pump.queue.put_nowait(Delta(StepDelta("r", (6,))))
        pump.replace_with(Failed(RuntimeError("gone")))
        message = await pump.get(1.0)
        assert isinstance(message, Failed) and str(message.error) == "gone" and pump.queue.empty()
    asyncio.run(go())


def test_track_and_wait_idle():
    async def go():
        runner = _runner(_Backend())
        assert await runner.wait_idle(0.01)          # nothing in flight
        done = asyncio.Event()

        async def call():
            with runner.track():
                await done.wait()

        tasks = [asyncio.create_task(call()) for _ in range(2)]
        await asyncio.sleep(0)
        assert runner.in_flight == 2
        assert not await runner.wait_idle(0.05)      # timed out with calls in flight
        waiter = asyncio.create_task(runner.wait_idle(5))
        done.set()
        assert await waiter and runner.in_flight == 0
        await asyncio.gather(*tasks)
    asyncio.run(go())

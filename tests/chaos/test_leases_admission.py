"""Fast, in-process pieces of the reliability story (no Ray):
- LeaseTable.renew and the pinned == active + ended invariant;
- a real PrefillWorker whose reader never comes: its lease expires and the
  blocks come back (the decode side vanished, nobody releases), while a
  renewed lease outlives its TTL;
- per-tenant fairness of admission (injected clock);
- the admission slot of a stream closed by a caller cancelled twice comes back
  (found by the disconnect trials: one slot leaked per ~20 trials);
- ... and of a stream whose consumer was dropped and garbage-collected on
  another thread (seen once in the gRPC frontend tests)."""
from __future__ import annotations

import asyncio

import pytest

from cluster.frontends.admission import AdmissionController, tenant_of
from cluster.orchestration.backend import BackendError, GenerateJob
from engine.sampling_params import SamplingParams
from kvtransfer.leases import LeaseTable, ReleaseCause
from worker_api.messages import WorkItem


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_renew_pushes_expiry_and_counts_stay_consistent():
    clock, freed = Clock(), []
    table = LeaseTable(clock, lambda lease, cause: freed.append((lease.request_id, cause)))
    table.pin("a", [1, 2], ttl=2.0)
    table.pin("b", [3], ttl=2.0)
    clock.t += 1.5
    assert table.renew("a", 2.0) and table.get("a").expires_at == clock.t + 2.0
    clock.t += 1.0                     # b's TTL is over, a's renewed one is not
    assert [lease.request_id for lease in table.expire_due()] == ["b"]
    assert table.renew("b", 2.0) is False, "an expired lease cannot be renewed back"
    assert table.renew("a", 0.5) and table.get("a").expires_at == clock.t + 1.0, "renew never shortens"
    with pytest.raises(ValueError, match="ttl"):
        table.renew("a", 0)
    clock.t += 5
    table.expire_due()
    assert freed == [("b", ReleaseCause.EXPIRED), ("a", ReleaseCause.EXPIRED)]
    assert table.pins == 2 == len(table) + sum(table.releases.values()) and table.renewals == 2


@pytest.fixture(scope="module")
def prefill_worker(tiny_llama_dir):
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvtransfer.settings import TransferSettings
    from prefill_worker.worker import PrefillWorker

    cfg = EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=32),
                       scheduler=SchedulerConfig(max_model_len=256))
    return PrefillWorker("prefill-t", cfg, TransferSettings(backend="tcp", lease_ttl=0.3, timeout=1.0))


def test_unread_lease_expires_and_frees_blocks_renewed_one_survives(prefill_worker):
    w = prefill_worker
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def go():
        gone = await w.prefill(item=WorkItem(request_id="gone", prompt_token_ids=tuple(range(3, 43)), sampling=params))
        kept = await w.prefill(item=WorkItem(request_id="kept", prompt_token_ids=tuple(range(50, 90)), sampling=params))
        assert gone.handle and kept.handle and (await w.check_integrity()).leases == 2
        for _ in range(30):                   # >= 1.5 s, 5 x the 0.3 s TTL: "gone" must expire
            assert w.renew(request_id="kept", ttl=1.0)   # "kept" is renewed all along
            await asyncio.sleep(0.05)
        mid = w.lease_counters()
        assert await w.release(request_id="kept")
        for _ in range(200):
            state = await w.check_integrity()
            if state.kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        return mid, w.lease_counters(), state

    mid, after, state = asyncio.run(go())
    assert (mid.active, mid.expired) == (1, 1), mid
    assert (after.active, after.expired, after.released, after.pinned) == (0, 1, 1, 2), after
    assert after.renewed == 30 and state.kv_blocks_used == 0 and state.held == 0


def _job(rid: str, salt: str | None, tokens: int = 10) -> GenerateJob:
    return GenerateJob(rid, tuple(range(tokens - 1)), SamplingParams(max_tokens=1), cache_salt=salt)


def test_one_tenant_cannot_starve_another():
    clock = Clock()
    adm = AdmissionController(max_requests=8, max_tokens=10_000, clock=clock)
    flood = [adm.admit(_job(f"a{i}", "alpha/x")) for i in range(8)]   # alone: it may use everything
    with pytest.raises(BackendError) as e:
        adm.admit(_job("b0", "beta"))
    assert e.value.code == "RESOURCE_EXHAUSTED" and e.value.retry_after_s > 0 and "busy" in e.value.message
    adm.release(flood.pop())                        # a slot frees up; alpha asks first ...
    with pytest.raises(BackendError) as e:
        adm.admit(_job("a8", "alpha/y"))
    assert "fair share is 4" in e.value.message and e.value.retry_after_s > 0
    adm.admit(_job("b0", "beta"))                    # ... but it is beta's
    for i in range(3):                               # alpha drains to its share; beta fills its own
        adm.release(flood.pop())
        adm.admit(_job(f"b{i + 1}", "beta"))
    assert adm.tenant_usage("alpha")[0] == 4 and adm.tenant_usage("beta")[0] == 4
    clock.t += 60                                    # nobody waits any more: no share is enforced
    adm.release(flood.pop())
    assert adm.admit(_job("a9", "alpha/z")) and adm.in_flight == 8


def test_fair_share_applies_to_tokens_and_idle_capacity_is_not_reserved():
    clock = Clock()
    adm = AdmissionController(max_requests=100, max_tokens=100, clock=clock)
    a = [adm.admit(_job(f"a{i}", "alpha", 20)) for i in range(5)]     # 100 tokens
    with pytest.raises(BackendError):
        adm.admit(_job("b0", "beta", 20))
    adm.release(a.pop())
    with pytest.raises(BackendError, match="fair share"):
        adm.admit(_job("a5", "alpha", 20))
    adm.admit(_job("b0", "beta", 20))
    clock.t += 60
    solo = AdmissionController(max_requests=4, max_tokens=100, clock=clock)
    assert [solo.admit(_job(f"s{i}", "gamma")) for i in range(4)]   # a lone tenant gets all of it


def test_tenant_is_the_salt_prefix():
    assert tenant_of(None) == tenant_of("") == ""
    assert tenant_of("alice") == "alice" and tenant_of("alice/session-7") == "alice"


class _OneTokenBackend:
    """Finishes every request with one token; aborts are recorded."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def tokenizer(self):
        return None

    async def generate(self, job):
        from engine.outputs import StepDelta
        yield StepDelta(job.request_id, (5,), finish_reason="length", num_prompt_tokens=3)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_admission_slot_comes_back_when_the_closing_caller_is_cancelled_twice():
    """A client that goes away as its last chunk is written: the handler closing the
    stream is cancelled again while it waits for the cleanup. The slot must come back."""
    from cluster.observability.metrics import Metrics
    from cluster.frontends.runner import RequestRunner
    from cluster.frontends.validation import GenerateInput, Limits, SamplingInput

    adm = AdmissionController(max_requests=4, max_tokens=1000)
    runner = RequestRunner(_OneTokenBackend(), Metrics(), Limits(max_model_len=64, block_size=16, vocab_size=100), adm)

    async def go():
        stream = runner.run(GenerateInput(prompt_token_ids=[1, 2, 3], sampling=SamplingInput(max_tokens=1)))
        chunk = await stream.__anext__()          # the last chunk: the stream now closes with finished=True
        assert chunk.finish_reason == "length" and adm.in_flight == 1
        closer = asyncio.create_task(stream.aclose())
        for _ in range(2):
            await asyncio.sleep(0)
            closer.cancel()
        await asyncio.gather(closer, return_exceptions=True)
        for _ in range(100):
            if not adm.in_flight:
                break
            await asyncio.sleep(0.01)
        return adm.in_flight

    assert asyncio.run(go()) == 0


class _EndlessBackend(_OneTokenBackend):
    """Streams a token per delta, forever (until closed or aborted)."""

    async def generate(self, job):
        from engine.outputs import StepDelta
        while True:
            yield StepDelta(job.request_id, (5,), num_prompt_tokens=3)
            await asyncio.sleep(0)


def test_admission_slot_comes_back_when_the_consumer_is_garbage_collected():
    """The transport drops the task that consumes a stream without cancelling it
    (seen once with grpc.aio after a client cancel: the handler and the pump were
    garbage-collected, on another thread, with the pump blocked on its full queue).
    The request must still be aborted and its admission slot come back."""
    import contextlib
    import gc
    import threading

    from cluster.observability.metrics import Metrics
    from cluster.frontends.runner import RequestRunner
    from cluster.frontends.validation import GenerateInput, Limits, SamplingInput

    adm, backend = AdmissionController(max_requests=4, max_tokens=10_000), _EndlessBackend()
    runner = RequestRunner(backend, Metrics(), Limits(max_model_len=64, block_size=16, vocab_size=100), adm)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def consume(started: asyncio.Future):   # as GenerationService._generate
        stream = runner.run(GenerateInput(prompt_token_ids=[1, 2, 3], sampling=SamplingInput(max_tokens=40)))
        async with contextlib.aclosing(stream):
            async for _ in stream:
                if not started.done():
                    started.set_result(None)
                await loop.create_future()    # a write that never completes, and nobody holds the task

    held: list = []                          # the transport's reference, dropped below

    async def start():
        started = loop.create_future()
        held.append(loop.create_task(consume(started)))
        await started
        for _ in range(200):                  # let the pump fill the queue and block on it
            await asyncio.sleep(0)

    async def settle():
        for _ in range(300):
            if not adm.in_flight and backend.aborted:
                break
            await asyncio.sleep(0.01)
        return adm.in_flight, list(backend.aborted)

    try:
        asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        assert adm.in_flight == 1
        held.clear()
        gc.collect()                           # on this thread: no event loop runs here
        in_flight, aborted = asyncio.run_coroutine_threadsafe(settle(), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert in_flight == 0, "the admission slot of a garbage-collected stream leaked"
    assert len(aborted) == 1, aborted


def test_a_consumer_that_stops_reading_is_given_up_after_consumer_timeout():
    """The consumer holds its stream open but takes nothing (stuck somewhere the transport's
    own bounds do not reach): once the pump has waited consumer_timeout on its full queue, the
    request is aborted and its slot freed while the consumer still holds the stream; if the
    consumer reads again it gets CANCELLED, not the stale backlog."""
    from cluster.orchestration.backend import BackendError
    from cluster.observability.metrics import Metrics
    from cluster.frontends.runner import RequestRunner
    from cluster.frontends.validation import GenerateInput, Limits, SamplingInput

    adm, backend, metrics = AdmissionController(max_requests=4, max_tokens=10_000), _EndlessBackend(), Metrics()
    runner = RequestRunner(backend, metrics, Limits(max_model_len=64, block_size=16, vocab_size=100), adm,
                           consumer_timeout=0.3)

    def cancelled() -> float:
        return metrics.registry.get_sample_value("pdserve_requests_total", {"outcome": "cancelled"}) or 0.0

    async def go():
        stream = runner.run(GenerateInput(prompt_token_ids=[1, 2, 3], sampling=SamplingInput(max_tokens=40)))
        first = await stream.__anext__()
        assert first.token_ids and adm.in_flight == 1
        for _ in range(500):                   # the consumer is away; the stream stays open
            if not adm.in_flight and backend.aborted:
                break
            await asyncio.sleep(0.01)
        freed, aborted = adm.in_flight == 0, list(backend.aborted)
        assert cancelled() == 1                 # counted when given up on, not when read again
        try:
            await stream.__anext__()
            code = None
        except BackendError as e:
            code = e.code
        await stream.aclose()
        assert cancelled() == 1
        return freed, aborted, code

    freed, aborted, code = asyncio.run(go())
    assert freed, "the admission slot of a stream nobody reads was not freed"
    assert len(aborted) >= 1
    assert code == "CANCELLED"


def test_consumer_timeout_must_not_be_negative():
    from cluster.observability.metrics import Metrics
    from cluster.frontends.runner import RequestRunner
    from cluster.frontends.validation import Limits

    with pytest.raises(ValueError, match="consumer_timeout must be >= 0"):
        RequestRunner(_EndlessBackend(), Metrics(), Limits(max_model_len=64, block_size=16, vocab_size=100),
                      AdmissionController(max_requests=1, max_tokens=100), consumer_timeout=-1)


class _ShortBackend(_OneTokenBackend):
    """Three tokens, then finished: everything fits in the runner's queue."""

    async def generate(self, job):
        from engine.outputs import StepDelta
        for i in range(3):
            yield StepDelta(job.request_id, (5,), finish_reason="length" if i == 2 else None, num_prompt_tokens=3)


def test_a_finished_request_whose_consumer_stopped_reading_frees_its_slot():
    """The backend finished and the whole output sits in the queue, but the consumer never
    reads it and never closes its stream (a handler its transport dropped): the pump must
    still free the slot after consumer_timeout. A consumer that reads to the end is not
    affected, and nothing is counted twice."""
    from cluster.observability.metrics import Metrics
    from cluster.frontends.runner import RequestRunner
    from cluster.frontends.validation import GenerateInput, Limits, SamplingInput

    adm, metrics = AdmissionController(max_requests=4, max_tokens=10_000), Metrics()
    runner = RequestRunner(_ShortBackend(), metrics, Limits(max_model_len=64, block_size=16, vocab_size=100), adm,
                           consumer_timeout=0.3)

    def outcome(name: str) -> float:
        return metrics.registry.get_sample_value("pdserve_requests_total", {"outcome": name}) or 0.0

    async def go():
        inp = GenerateInput(prompt_token_ids=[1, 2, 3], sampling=SamplingInput(max_tokens=3))
        full = [c async for c in runner.run(inp)]             # read to the end: finished, slot back
        assert full[-1].finish_reason == "length" and adm.in_flight == 0 and outcome("finished") == 1
        stream = runner.run(inp)
        await stream.__anext__()                              # then the consumer goes away
        for _ in range(500):
            if not adm.in_flight:
                break
            await asyncio.sleep(0.01)
        freed = adm.in_flight == 0
        await stream.aclose()
        return freed

    assert asyncio.run(go()), "the slot of a finished request nobody read was not freed"
    assert outcome("cancelled") == 1 and outcome("finished") == 1

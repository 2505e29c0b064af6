"""Run one validated request against a backend: transport-neutral streaming.

`RequestRunner.run` validates a `GenerateInput`, admits it, iterates the
backend in a pump task (the deadline is enforced there; the task isolates the
backend iterator from the transport's cancellation points) and yields
`Chunk`s in arrival order; with n > 1 the backend tags deltas with `index`. It records the frontend metrics: TTFT (once
per request), inter-token latency (each gap of a sequence), end-to-end
latency, token counters, queue depth and `requests{outcome}`. Leaving early
(client gone, deadline, error) closes the backend iterators, which aborts the
requests and frees their blocks, and calls `backend.abort` to be sure. That
cleanup also runs when the transport drops a consumer without cancelling it
and the garbage collector closes the stream, on whatever thread. And a
consumer that takes nothing for `consumer_timeout` seconds while output waits
for it (stuck in a write, or dropped by its transport and never collected) is
given up on: the pump aborts the request, frees its admission slot and leaves
the consumer a CANCELLED error to find if it ever reads again.
Errors surface as `ValidationError` or `BackendError` (code = grpc status name).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from dataclasses import dataclass
from typing import AsyncIterator

from cluster.frontends.admission import AdmissionController
from cluster.orchestration.backend import BackendError, GenerateJob, GenerationBackend
from cluster.observability.metrics import Metrics
from cluster.observability.task_trace import describe_task
from cluster.frontends.validation import GenerateInput, Limits, ValidationError, validate_request
from engine.outputs import StepDelta, TokenLogprob

_END = object()
log = logging.getLogger(__name__)
QUEUE_DEPTH = 64    # deltas buffered per request before the backend is made to wait


@dataclass(frozen=True)
class Chunk:
    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: tuple[TokenLogprob, ...]
    prompt_tokens: int
    completion_tokens: int             # of this sequence so far
    cached_tokens: int
    time_to_first_token_s: float | None   # set once the sequence has produced a token
    elapsed_s: float                   # arrival -> this chunk
    first: bool                        # first chunk of this sequence


@dataclass
class _Seq:
    finished: bool = False
    tokens: int = 0
    cached: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    sent: int = 0


def outcome_of(exc: BaseException | None) -> str:
    """Label of `pdserve_requests{outcome}`: finished or the lower-case status name."""
    if exc is None:
        return "finished"
    if isinstance(exc, ValidationError):
        return "invalid_argument"
    if isinstance(exc, BackendError):
        return exc.code.lower()
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    return "internal"


class _ConsumerStalled(Exception):
    """The pump's queue stayed full for consumer_timeout: nobody reads the stream."""


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class RequestRunner:
    def __init__(self, backend: GenerationBackend, metrics: Metrics, limits: Limits,
                 admission: AdmissionController, consumer_timeout: float = 0.0) -> None:
        if consumer_timeout < 0:
            raise ValueError(f"consumer_timeout must be >= 0 seconds (0 = no bound), got {consumer_timeout}")
        self.backend = backend
        self.consumer_timeout = consumer_timeout   # seconds output may wait on a consumer; 0 = no bound
        self.metrics = metrics
        self.limits = limits
        self.admission = admission
        self._cleanups: set[asyncio.Task] = set()
        # held here, not only by the consumer's frame: a consumer the transport drops without
        # cancelling it is garbage-collected, and its pump must still be there to be cancelled
        self._pumps: set[asyncio.Task] = set()

    def validate(self, inp: GenerateInput, *, cache_salt: str | None, deadline: float | None,
                 arrival_time: float) -> GenerateJob:
        return validate_request(inp, self.backend.tokenizer(), self.limits, cache_salt=cache_salt,
                                deadline=deadline, arrival_time=arrival_time)

    async def run(self, inp: GenerateInput, *, cache_salt: str | None = None,
                  deadline: float | None = None) -> AsyncIterator[Chunk]:
        """Validate, admit and stream. `deadline` is a time.monotonic() instant."""
        arrival = time.monotonic()
        error: BaseException | None = None
        done = counted = False

        def count(outcome: str) -> None:   # once per request: here, or by a pump that gave up
            nonlocal counted
            if not counted:
                counted = True
                self.metrics.requests.labels(outcome=outcome).inc()

        try:
            job = self.validate(inp, cache_salt=cache_salt, deadline=deadline, arrival_time=arrival)
            ticket = self.admission.admit(job)
            self.metrics.prompt_tokens.inc(len(job.prompt_token_ids))
            async with contextlib.aclosing(self._stream(job, lambda: self.admission.release(ticket), count)) as s:
                async for chunk in s:
                    yield chunk
            done = True
        except BaseException as e:
            error = e
            raise
        finally:
            count(outcome_of(None if done else error))
            if done:
                self.metrics.e2e.observe(time.monotonic() - arrival)

    async def wait_cleanups(self, timeout: float | None = None) -> None:
        """Wait for the aborts of requests that ended early (e.g. before shutting down)."""
        if self._cleanups:
            await asyncio.wait(set(self._cleanups), timeout=timeout)

    async def _stream(self, job: GenerateJob, release, count) -> AsyncIterator[Chunk]:
        seqs = [_Seq() for _ in range(job.sampling.n)]
        queue: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_DEPTH)
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()   # weakly: a consumer its transport dropped must stay collectable
        consumer = weakref.ref(task) if task is not None else None
        pump = asyncio.create_task(self._pump(job, queue, release, count, consumer))
        self._pumps.add(pump)
        pump.add_done_callback(self._pumps.discard)
        first_token_seen = False
        try:
            left = len(seqs)
            while left:
                item = await self._next(queue, job)
                if item is _END:
                    raise BackendError("UNAVAILABLE", "the backend ended the stream before finishing "
                                       f"{left} of {len(seqs)} sequences; retry the request")
                if isinstance(item, BaseException):
                    raise item
                if not 0 <= item.index < len(seqs) or seqs[item.index].finished:
                    raise BackendError("INTERNAL", f"the backend sent a delta for sequence {item.index}, "
                                       f"which is not running (n={len(seqs)})")
                seq = seqs[item.index]
                chunk = self._chunk(job, item.index, seq, item)
                if chunk.token_ids and not first_token_seen:
                    first_token_seen = True
                    self.metrics.ttft.observe(chunk.time_to_first_token_s)
                    if item.queue_seconds is not None:
                        self.metrics.queue_time.observe(item.queue_seconds)
                if item.finish_reason:
                    seq.finished = True
                    left -= 1
                yield chunk
        finally:
            # Aborting can wait on a busy engine: do it in the background so the client hears
            # at once; the admission ticket is held until the blocks are really freed.
            finished = all(s.finished for s in seqs)
            if _running_loop() is loop:
                task = self._start_cleanup(pump, job, finished, release)
                if finished:   # shielded: a second cancellation of the caller must not cancel the cleanup
                    await asyncio.shield(task)
            else:   # closed by the garbage collector on another thread (a dropped consumer)
                loop.call_soon_threadsafe(self._start_cleanup, pump, job, finished, release)

    def _start_cleanup(self, pump: asyncio.Task, job: GenerateJob, finished: bool, release) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self._cleanup(pump, job, finished, release))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        # a cleanup cancelled before it ran must still give the admission slot back
        task.add_done_callback(lambda t: release() if t.cancelled() else None)
        return task

    @staticmethod
    async def _next(queue: asyncio.Queue, job: GenerateJob):
        left = None if job.deadline is None else max(0.0, job.deadline - time.monotonic())
        try:
            async with asyncio.timeout(left):
                item = await queue.get()
            queue.task_done()   # the pump waits for the consumer to take everything (queue.join)
            return item
        except TimeoutError:
            raise BackendError("DEADLINE_EXCEEDED", "the request ran past its deadline "
                               f"({job.deadline - job.arrival_time:.3g} s after arrival); allow more time "
                               "(client deadline / server request_timeout) or ask for fewer tokens") from None

    def _chunk(self, job: GenerateJob, index: int, seq: _Seq, d: StepDelta) -> Chunk:
        now = time.monotonic()
        if d.new_token_ids:
            if seq.last_token_at is not None:
                self.metrics.itl.observe(now - seq.last_token_at)
            seq.first_token_at = seq.first_token_at or now
            seq.last_token_at = now
            seq.tokens += len(d.new_token_ids)
            self.metrics.generation_tokens.inc(len(d.new_token_ids))
        seq.cached = max(seq.cached, d.num_cached_tokens)
        seq.sent += 1
        ttft = None if seq.first_token_at is None else seq.first_token_at - job.arrival_time
        return Chunk(request_id=job.request_id, index=index, token_ids=tuple(d.new_token_ids),
                     text=d.new_text, finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                     logprobs=tuple(d.logprobs), prompt_tokens=d.num_prompt_tokens or len(job.prompt_token_ids),
                     completion_tokens=seq.tokens, cached_tokens=seq.cached, time_to_first_token_s=ttft,
                     elapsed_s=now - job.arrival_time, first=seq.sent == 1)

    async def _pump(self, job: GenerateJob, queue: asyncio.Queue, release, count,
                    consumer: weakref.ref | None = None) -> None:
        """Drain the backend iterator into the queue, in its own task: the transport's
        cancellation never lands inside the backend's iterator."""
        agen = None
        stalled = False
        error: Exception | None = None
        try:
            agen = self.backend.generate(job)
            async for delta in agen:
                await self._put(queue, delta)
            await self._put(queue, _END)
            await self._taken(queue)
        except asyncio.CancelledError:
            raise
        except _ConsumerStalled:
            stalled = True
        except Exception as e:   # surfaced to the consumer, which maps it to a status
            error = e
        finally:
            aclose = getattr(agen, "aclose", None)   # closing the iterator aborts the request
            if aclose is not None:
                await aclose()
        if error is not None:
            try:
                await self._put(queue, error)
                await self._taken(queue)
            except _ConsumerStalled:
                stalled = True
        if stalled:
            await self._give_up(job, queue, release, consumer)
            count("cancelled")

    async def _put(self, queue: asyncio.Queue, item) -> None:
        if not queue.full():   # the common case: no timer per delta
            queue.put_nowait(item)
            return
        try:
            async with asyncio.timeout(self.consumer_timeout or None):
                await queue.put(item)
        except TimeoutError:
            raise _ConsumerStalled from None

    async def _taken(self, queue: asyncio.Queue) -> None:
        """Until the consumer has taken what is queued (its stream closing cancels this wait):
        a consumer dropped by its transport, whose stream is never closed, must not keep the
        slot of a request that finished in the backend either."""
        if self.consumer_timeout <= 0:
            return
        try:
            async with asyncio.timeout(self.consumer_timeout):
                await queue.join()
        except TimeoutError:
            raise _ConsumerStalled from None

    async def _give_up(self, job: GenerateJob, queue: asyncio.Queue, release,
                       consumer: weakref.ref | None) -> None:
        """The consumer took nothing for consumer_timeout: abort (the iterator is closed
        already), free the slot, and leave the consumer an error instead of its backlog."""
        log.warning("request %s: its stream was not read for %g s; aborting it (the consumer waits in %s)",
                    job.request_id, self.consumer_timeout, describe_task(consumer and consumer()))
        await self._abort(job)
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(BackendError("CANCELLED", f"nothing was read from the stream for "
                                      f"{self.consumer_timeout:g} s (stream_write_timeout); the request was aborted"))
        release()

    async def _cleanup(self, pump: asyncio.Task, job: GenerateJob, finished: bool, release) -> None:
        try:
            if not pump.done():
                pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            if not finished:
                await self._abort(job)
        finally:
            release()

    async def _abort(self, job: GenerateJob) -> None:
        try:
            await self.backend.abort(job.request_id)
        except Exception:   # best effort: closing the iterator has aborted it already
            log.warning("backend.abort(%s) failed", job.request_id, exc_info=True)

"""Run one validated request against a backend: transport-neutral streaming.

One `RequestRunner` per serving process, built by the server stack and given
to each frontend (gRPC, HTTP); it owns what they share:
- validation and admission (`run` validates a `GenerateInput` and admits it);
- the deadline: the job's deadline is the client's (the frontends only turn the
  client's timeout into a time.monotonic() instant) or `request_timeout` after
  arrival, whichever comes first, and it is enforced here, on every wait for
  the backend's next delta;
- the frontend metrics: TTFT (once per request), inter-token latency (each gap
  of a sequence), end-to-end latency, token counters, queue depth and
  `requests{outcome}`;
- in-flight tracking for graceful drain: each frontend wraps a call in
  `track()`, and `wait_idle` waits until none is left.

The backend iterator runs in a pump task (cluster/frontends/pump.py; the task
isolates it from the transport's cancellation points) and `run` yields `Chunk`s
in arrival order; with n > 1 the backend tags deltas with `index`. Leaving
early (client gone, deadline, error) closes the backend iterators, which
aborts the requests and frees their blocks, and calls `backend.abort` to be
sure. That cleanup also runs when the transport drops a consumer without
cancelling it and the garbage collector closes the stream, on whatever thread.
And a consumer that takes nothing for `consumer_timeout` seconds while output
waits for it (stuck in a write, or dropped by its transport and never
collected) is given up on: the pump aborts the request, frees its admission
slot and leaves the consumer a CANCELLED error to find if it ever reads again.
Errors surface as `ValidationError` or `BackendError` (code = grpc status name).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterator

from cluster.frontends.admission import AdmissionController
from cluster.frontends.pump import Delta, End, Failed, Message, Pump
from cluster.frontends.validation import GenerateInput, Limits, ValidationError, validate_request
from cluster.observability.metrics import Metrics
from cluster.observability.task_trace import describe_task
from cluster.orchestration.backend import BackendError, GenerateJob, GenerationBackend
from engine.outputs import StepDelta, TokenLogprob

if TYPE_CHECKING:
    from cluster.config import ServeConfig

log = logging.getLogger(__name__)


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


@dataclass
class _Progress:
    """The sequences of one request as its deltas arrive."""
    seqs: list[_Seq]
    first_token_seen: bool = False

    @property
    def left(self) -> int:
        return sum(not s.finished for s in self.seqs)


@dataclass
class _Counted:
    """`pdserve_requests{outcome}`, once per request: by its stream, or by a pump that gave up."""
    metrics: Metrics
    done: bool = field(default=False)

    def __call__(self, outcome: str) -> None:
        if not self.done:
            self.done = True
            self.metrics.requests.labels(outcome=outcome).inc()


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


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class RequestRunner:
    def __init__(self, backend: GenerationBackend, metrics: Metrics, limits: Limits,
                 admission: AdmissionController, consumer_timeout: float = 0.0,
                 request_timeout: float = 0.0) -> None:
        if consumer_timeout < 0:
            raise ValueError(f"consumer_timeout must be >= 0 seconds (0 = no bound), got {consumer_timeout}")
        if request_timeout < 0:
            raise ValueError(f"request_timeout must be >= 0 seconds (0 = no deadline), got {request_timeout}")
        self.backend = backend
        self.consumer_timeout = consumer_timeout   # seconds output may wait on a consumer; 0 = no bound
        self.request_timeout = request_timeout     # the server's deadline after arrival; 0 = none
        self.metrics = metrics
        self.limits = limits
        self.admission = admission
        self._cleanups: set[asyncio.Task] = set()
        # held here, not only by the consumer's frame: a consumer the transport drops without
        # cancelling it is garbage-collected, and its pump must still be there to be cancelled
        self._pumps: set[asyncio.Task] = set()
        self._in_flight = 0
        self._idle_waiters: set[asyncio.Event] = set()

    @classmethod
    def from_config(cls, backend: GenerationBackend, config: "ServeConfig", metrics: Metrics,
                    limits: Limits | None = None) -> "RequestRunner":
        """The runner a serving process shares among its frontends. `backend` must be started."""
        admission = AdmissionController(config.max_queued_requests, config.max_queued_tokens,
                                        on_change=metrics.frontend_queue.set)
        return cls(backend, metrics, limits or Limits.from_model(backend.model_info()), admission,
                   consumer_timeout=config.stream_write_timeout, request_timeout=config.request_timeout)

    # ------------------------------------------------------------------ in flight (graceful drain)
    @property
    def in_flight(self) -> int:
        """Frontend calls inside `track()` now."""
        return self._in_flight

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count one frontend call (a gRPC Generate, an HTTP generation response) as in flight
        from its start to its last write; draining waits for zero."""
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                for idle in self._idle_waiters:
                    idle.set()

    async def wait_idle(self, timeout: float | None) -> bool:
        """Until no tracked call is in flight; False if `timeout` seconds passed first."""
        idle = asyncio.Event()
        self._idle_waiters.add(idle)
        try:
            async with asyncio.timeout(timeout):
                while self._in_flight:
                    idle.clear()
                    await idle.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self._idle_waiters.discard(idle)

    async def wait_cleanups(self, timeout: float | None = None) -> None:
        """Wait for the aborts of requests that ended early (e.g. before shutting down)."""
        if self._cleanups:
            await asyncio.wait(set(self._cleanups), timeout=timeout)

    # ------------------------------------------------------------------ one request
    def deadline(self, client_deadline: float | None, arrival_time: float) -> float | None:
        """The job's deadline: the client's (a time.monotonic() instant, None = none) or
        `request_timeout` after arrival, whichever comes first."""
        t = self.request_timeout
        server = arrival_time + t if t > 0 and math.isfinite(t) else None
        return min((d for d in (client_deadline, server) if d is not None), default=None)

    def validate(self, inp: GenerateInput, *, cache_salt: str | None, deadline: float | None,
                 arrival_time: float) -> GenerateJob:
        return validate_request(inp, self.backend.tokenizer(), self.limits, cache_salt=cache_salt,
                                deadline=deadline, arrival_time=arrival_time)

    async def run(self, inp: GenerateInput, *, cache_salt: str | None = None,
                  deadline: float | None = None) -> AsyncIterator[Chunk]:
        """Validate, admit and stream. `deadline`: the client's, a time.monotonic() instant
        (None = none); the server's `request_timeout` bounds it too."""
        arrival = time.monotonic()
        count = _Counted(self.metrics)
        error: BaseException | None = None
        done = False
        try:
            job = self.validate(inp, cache_salt=cache_salt, deadline=self.deadline(deadline, arrival),
                                arrival_time=arrival)
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

    async def _stream(self, job: GenerateJob, release: Callable[[], None],
                      count: _Counted) -> AsyncIterator[Chunk]:
        loop = asyncio.get_running_loop()
        pump = Pump(self.consumer_timeout)
        task = asyncio.current_task()   # weakly: a consumer its transport dropped must stay collectable
        consumer = weakref.ref(task) if task is not None else None
        pumping = asyncio.create_task(self._pump(job, pump, release, count, consumer))
        self._pumps.add(pumping)
        pumping.add_done_callback(self._pumps.discard)
        progress = _Progress([_Seq() for _ in range(job.sampling.n)])
        try:
            while (chunk := await self._receive(job, pump, progress)) is not None:
                yield chunk
        finally:
            # Aborting can wait on a busy engine: do it in the background so the client hears
            # at once; the admission ticket is held until the blocks are really freed.
            finished = not progress.left
            if _running_loop() is loop:
                cleanup = self._start_cleanup(pumping, job, finished, release)
                if finished:   # shielded: a second cancellation of the caller must not cancel the cleanup
                    await asyncio.shield(cleanup)
            else:   # closed by the garbage collector on another thread (a dropped consumer)
                loop.call_soon_threadsafe(self._start_cleanup, pumping, job, finished, release)

    async def _receive(self, job: GenerateJob, pump: Pump, progress: _Progress) -> Chunk | None:
        """The next chunk; None once every sequence has finished."""
        left = progress.left
        if not left:
            return None
        match await self._next(pump, job):
            case Delta(delta):
                return self._on_delta(job, progress, delta)
            case Failed(error):
                raise error
            case End():
                raise BackendError("UNAVAILABLE", "the backend ended the stream before finishing "
                                   f"{left} of {len(progress.seqs)} sequences; retry the request")
        raise AssertionError("unreachable")   # pragma: no cover - Message is closed

    @staticmethod
    async def _next(pump: Pump, job: GenerateJob) -> Message:
        """The next message, within the job's deadline (the one place it is enforced)."""
        left = None if job.deadline is None else max(0.0, job.deadline - time.monotonic())
        try:
            return await pump.get(left)
        except TimeoutError:
            raise BackendError("DEADLINE_EXCEEDED", "the request ran past its deadline "
                               f"({job.deadline - job.arrival_time:.3g} s after arrival); allow more time "
                               "(client deadline / server request_timeout) or ask for fewer tokens") from None

    def _on_delta(self, job: GenerateJob, progress: _Progress, d: StepDelta) -> Chunk:
        seqs = progress.seqs
        if not 0 <= d.index < len(seqs) or seqs[d.index].finished:
            raise BackendError("INTERNAL", f"the backend sent a delta for sequence {d.index}, "
                               f"which is not running (n={len(seqs)})")
        seq = seqs[d.index]
        chunk = self._chunk(job, d.index, seq, d)
        if chunk.token_ids and not progress.first_token_seen:
            progress.first_token_seen = True
            self.metrics.ttft.observe(chunk.time_to_first_token_s)
            if d.queue_seconds is not None:
                self.metrics.queue_time.observe(d.queue_seconds)
        if d.finish_reason:
            seq.finished = True
        return chunk

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

    # ------------------------------------------------------------------ the pump and the cleanup
    async def _pump(self, job: GenerateJob, pump: Pump, release: Callable[[], None], count: _Counted,
                    consumer: weakref.ref | None = None) -> None:
        """Drain the backend into `pump`, in its own task: the transport's cancellation never
        lands inside the backend's iterator. A consumer that took nothing for consumer_timeout
        is given up on: abort (the iterator is closed already), free the slot, and leave the
        consumer an error instead of its backlog."""
        if await pump.drain(lambda: self.backend.generate(job)):
            return
        log.warning("request %s: its stream was not read for %g s; aborting it (the consumer waits in %s)",
                    job.request_id, self.consumer_timeout, describe_task(consumer and consumer()))
        await self._abort(job)
        pump.replace_with(Failed(BackendError("CANCELLED", f"nothing was read from the stream for "
                                              f"{self.consumer_timeout:g} s (stream_write_timeout); "
                                              "the request was aborted")))
        release()
        count("cancelled")

    def _start_cleanup(self, pumping: asyncio.Task, job: GenerateJob, finished: bool,
                       release: Callable[[], None]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self._cleanup(pumping, job, finished, release))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        # a cleanup cancelled before it ran must still give the admission slot back
        task.add_done_callback(lambda t: release() if t.cancelled() else None)
        return task

    async def _cleanup(self, pumping: asyncio.Task, job: GenerateJob, finished: bool,
                       release: Callable[[], None]) -> None:
        try:
            if not pumping.done():
                pumping.cancel()
            await asyncio.gather(pumping, return_exceptions=True)
            if not finished:
                await self._abort(job)
        finally:
            release()

    async def _abort(self, job: GenerateJob) -> None:
        try:
            await self.backend.abort(job.request_id)
        except Exception:   # best effort: closing the iterator has aborted it already
            log.warning("backend.abort(%s) failed", job.request_id, exc_info=True)

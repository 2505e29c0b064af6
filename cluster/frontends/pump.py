"""The hand-over between a backend's delta iterator and one request's stream.

A `Pump` drains `backend.generate(job)` into a bounded queue from its own task
(so the transport's cancellation never lands inside the backend's iterator).
The queue carries typed messages, one of:

    Delta(delta)   a StepDelta of one sequence
    Failed(error)  the backend raised; the consumer re-raises it
    End()          the iterator finished (the consumer checks every sequence did)

A consumer that takes nothing for `consumer_timeout` seconds while output waits
stalls the pump (`drain` returns False); the runner then aborts the request and
`replace_with` leaves the consumer an error instead of its backlog.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Union

from engine.outputs import StepDelta

QUEUE_DEPTH = 64    # deltas buffered per request before the backend is made to wait


@dataclass(frozen=True)
class Delta:
    delta: StepDelta


@dataclass(frozen=True)
class Failed:
    error: Exception


@dataclass(frozen=True)
class End:
    pass


Message = Union[Delta, Failed, End]


class ConsumerStalled(Exception):
    """The queue stayed full (or unread) for consumer_timeout: nobody reads the stream."""


class Pump:
    def __init__(self, consumer_timeout: float = 0.0, depth: int = QUEUE_DEPTH) -> None:
        self.consumer_timeout = consumer_timeout   # seconds output may wait on the consumer; 0 = no bound
        self.queue: asyncio.Queue[Message] = asyncio.Queue(maxsize=depth)

    async def drain(self, open_deltas: Callable[[], AsyncIterator[StepDelta]]) -> bool:
        """Every delta of `open_deltas()`, then End (or Failed), into the queue; False if the
        consumer stalled. The iterator is closed on the way out (closing it aborts the request)."""
        error: Exception | None = None
        deltas = None
        try:
            deltas = open_deltas()
            async for delta in deltas:
                await self._put(Delta(delta))
            await self._put(End())
            await self._taken()
        except asyncio.CancelledError:
            raise
        except ConsumerStalled:
            return False
        except Exception as e:   # surfaced to the consumer, which maps it to a status
            error = e
        finally:
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                await aclose()
        if error is None:
            return True
        return await self.deliver(Failed(error))

    async def deliver(self, message: Message) -> bool:
        """Queue `message` and wait until the consumer took it; False if it stalled."""
        try:
            await self._put(message)
            await self._taken()
            return True
        except ConsumerStalled:
            return False

    def replace_with(self, message: Message) -> None:
        """Drop what the consumer never read and leave it `message` instead."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(message)

    async def get(self, timeout: float | None) -> Message:
        """The next message (TimeoutError after `timeout` seconds; None = no bound)."""
        async with asyncio.timeout(timeout):
            message = await self.queue.get()
        self.queue.task_done()   # drain() waits for the consumer to take everything (queue.join)
        return message

    async def _put(self, message: Message) -> None:
        if not self.queue.full():   # the common case: no timer per delta
            self.queue.put_nowait(message)
            return
        try:
            async with asyncio.timeout(self.consumer_timeout or None):
                await self.queue.put(message)
        except TimeoutError:
            raise ConsumerStalled from None

    async def _taken(self) -> None:
        """Until the consumer has taken what is queued (its stream closing cancels this wait):
        a consumer dropped by its transport, whose stream is never closed, must not keep the
        slot of a request that finished in the backend either."""
        if self.consumer_timeout <= 0:
            return
        try:
            async with asyncio.timeout(self.consumer_timeout):
                await self.queue.join()
        except TimeoutError:
            raise ConsumerStalled from None

"""Server-sent events, and the response that watches the client while it works.

`GenerationResponse` wraps an async iterator of body pieces (SSE events, or
the one JSON document of a non-streaming reply). It decides the status from
the first piece: a failure before it becomes a plain OpenAI error response
(400 / 429 / 503 ... with the right headers); a failure after it (headers
already sent) becomes an SSE `error` event followed by `data: [DONE]`.
While it works it listens for `http.disconnect`: a client that goes away
cancels the work, which closes the runner streams, aborts the requests and
frees their blocks (the same path as a cancelled gRPC call). So does a client
that stays connected but reads nothing: a send that waits `write_timeout`
seconds for the socket to drain ends the response (the connection is closed).
Every piece is sent as its own `http.response.body` message, so it leaves at
once (the server sets TCP_NODELAY on every connection).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from cluster.frontends.http.errors import OpenAIError

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
JSON_HEADERS = [(b"content-type", b"application/json")]
log = logging.getLogger(__name__)


def sse_event(payload: str) -> bytes:
    return b"data: " + payload.encode("utf-8") + b"\n\n"


def sse_error(err: OpenAIError) -> bytes:
    return sse_event(json.dumps(err.body().model_dump()))


class GenerationResponse(Response):
    """ASGI response over `body` (see the module doc). `to_error` maps an exception to the
    OpenAIError the client sees; `tracker` counts the response as in flight (drain waits)."""

    def __init__(self, body: AsyncIterator[bytes], *, streaming: bool,
                 to_error: Callable[[BaseException], OpenAIError], tracker=None,
                 write_timeout: float = 0.0) -> None:
        super().__init__(content=b"", status_code=200)
        self.write_timeout = write_timeout   # seconds one send may wait on a client reading nothing; 0 = no bound
        self.body_iter = body
        self.streaming = streaming
        self.to_error = to_error
        self.tracker = tracker or contextlib.nullcontext()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with self.tracker:
            work = asyncio.ensure_future(self._produce(scope, receive, send))
            gone = asyncio.ensure_future(_wait_disconnect(receive))
            try:
                await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not work.done():      # the client left first: stop generating
                    work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            finally:
                gone.cancel()
                await asyncio.gather(gone, return_exceptions=True)
                with contextlib.suppress(Exception):
                    await self.body_iter.aclose()

    async def _produce(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        try:
            async for piece in self.body_iter:
                if not started:
                    headers = SSE_HEADERS if self.streaming else JSON_HEADERS
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
                    started = True
                await self._send(send, {"type": "http.response.body", "body": piece, "more_body": True})
        except asyncio.CancelledError:
            raise
        except OSError:           # the client is gone; nothing more to tell it
            return
        except _Stalled:          # the client reads nothing: the server drops the connection
            log.info("HTTP response dropped: the client read nothing for %g s (stream_write_timeout)",
                     self.write_timeout)
            return
        except Exception as e:
            err = self.to_error(e)
            if not started:
                await err.response()(scope, receive, send)
                return
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": sse_error(err) + DONE, "more_body": True})
        if not started:
            await send({"type": "http.response.start", "status": 200,
                        "headers": SSE_HEADERS if self.streaming else JSON_HEADERS})
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send(self, send: Send, message: dict) -> None:
        try:
            async with asyncio.timeout(self.write_timeout or None):
                await send(message)
        except TimeoutError:
            raise _Stalled from None


class _Stalled(Exception):
    """A body send waited `write_timeout` on a client that reads nothing."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return

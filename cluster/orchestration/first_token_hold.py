"""Holding a hand-off's first token until the decode node has the request
(`first_token_release: decode`).

The prefill node samples the first token; the decode node computes the second one
step after it takes the request into its running batch. Streamed at once, the first
token is followed by a gap of pull + the wait for the decode engine's next step + that
step (up to two steps). Held until the decode node reports the request admitted (its
tokenless `admitted` delta, sent as the step that computes the second token starts),
the client's first gap is one decode step; the wait moves into the time to first
token instead (what SGLang's and vLLM's P/D modes do in effect).

The hold ends at the admission, or as soon as waiting for it makes no sense: the
join ended without a clean pull (recomputed, failed, moved), a recovery began (the
decode node died or drained), or any later message about the request arrived. The
caller streams the held token exactly once, right after `wait` returns; a request
that ends at its first token is never held.
"""
from __future__ import annotations

import asyncio


class FirstTokenHold:
    def __init__(self) -> None:
        self._over = asyncio.Event()
        self.expect_admission = False   # the decode node joined it by a clean pull: an admission follows
        self.reason = ""                # why the hold ended

    @property
    def over(self) -> bool:
        return self._over.is_set()

    def end(self, reason: str) -> None:
        """The token may go now; the first reason given is kept."""
        if not self._over.is_set():
            self.reason = reason
            self._over.set()

    async def wait(self, joining: asyncio.Future) -> None:
        """Until the hold ends, or `joining` (the submit to the decode node) ends without
        a clean pull. Returns also when `joining` failed: the caller streams the token,
        then meets the error."""
        over = asyncio.ensure_future(self._over.wait())
        try:
            await asyncio.wait({joining, over}, return_when=asyncio.FIRST_COMPLETED)
            if self.over:
                return
            if joining.cancelled() or joining.exception() is not None or not self.expect_admission:
                self.end("joined without a clean pull")
                return
            await over
        finally:
            over.cancel()

"""Frontend admission control: bounded in-flight requests and queued tokens.

A request costs `n * (prompt tokens + max_tokens)` tokens, the most KV it can
ever hold. Past `max_queued_requests` requests or `max_queued_tokens` tokens
in flight, new requests are refused with RESOURCE_EXHAUSTED and a retry hint
estimated from recent request durations, never queued without bound.
Transport-neutral: gRPC and HTTP share one controller per process.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from cluster.backend import BackendError, GenerateJob

_MIN_RETRY_S, _MAX_RETRY_S, _DEFAULT_RETRY_S = 0.05, 30.0, 1.0


@dataclass
class Ticket:
    request_id: str
    tokens: int
    admitted_at: float


class AdmissionController:
    def __init__(self, max_requests: int, max_tokens: int, on_change=None) -> None:
        if max_requests < 1 or max_tokens < 1:
            raise ValueError("max_queued_requests and max_queued_tokens must be >= 1")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._in_flight: dict[str, Ticket] = {}
        self._tokens = 0
        self._ema_duration: float | None = None
        self._on_change = on_change or (lambda n: None)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def queued_tokens(self) -> int:
        return self._tokens

    @staticmethod
    def cost(job: GenerateJob) -> int:
        return job.sampling.n * (len(job.prompt_token_ids) + job.sampling.max_tokens)

    def admit(self, job: GenerateJob) -> Ticket:
        """Reserve capacity for `job` or raise BackendError (RESOURCE_EXHAUSTED, ALREADY_EXISTS)."""
        if job.request_id in self._in_flight:
            raise BackendError("ALREADY_EXISTS", f"request_id {job.request_id!r} is already in flight; "
                               "use a unique id per request (or leave it empty)")
        tokens = self.cost(job)
        if tokens > self.max_tokens:
            raise BackendError("RESOURCE_EXHAUSTED", f"the request needs {tokens} tokens (n x (prompt + "
                               f"max_tokens)), more than the server's max_queued_tokens {self.max_tokens}; "
                               "lower max_tokens or n")
        if len(self._in_flight) >= self.max_requests or self._tokens + tokens > self.max_tokens:
            raise BackendError("RESOURCE_EXHAUSTED",
                               f"server busy: {len(self._in_flight)} requests / {self._tokens} tokens in "
                               f"flight (limits {self.max_requests} / {self.max_tokens}); retry later",
                               retry_after_s=self.retry_after_s())
        ticket = Ticket(job.request_id, tokens, time.monotonic())
        self._in_flight[job.request_id] = ticket
        self._tokens += tokens
        self._on_change(len(self._in_flight))
        return ticket

    def release(self, ticket: Ticket) -> None:
        if self._in_flight.get(ticket.request_id) is not ticket:
            return   # released already
        del self._in_flight[ticket.request_id]
        self._tokens -= ticket.tokens
        d = time.monotonic() - ticket.admitted_at
        self._ema_duration = d if self._ema_duration is None else 0.8 * self._ema_duration + 0.2 * d
        self._on_change(len(self._in_flight))

    def retry_after_s(self) -> float:
        """When a slot is likely to free up: mean duration spread over the requests in flight."""
        if self._ema_duration is None:
            return _DEFAULT_RETRY_S
        est = self._ema_duration / max(1, len(self._in_flight))
        return min(_MAX_RETRY_S, max(_MIN_RETRY_S, est))

"""Frontend admission control: bounded in-flight requests and queued tokens,
shared fairly among tenants.

A request costs `n * (prompt tokens + max_tokens)` tokens, the most KV it can
ever hold. Past `max_queued_requests` requests or `max_queued_tokens` tokens
in flight, new requests are refused with RESOURCE_EXHAUSTED and a retry hint
estimated from recent request durations, never queued without bound.

Fairness: the tenant of a request is the first `/`-separated part of its
cache salt (with API keys on, the salt starts with the key's tenant; without
keys it is whatever the client sent, "" when none). Each of the T tenants in
play (holding requests, or refused within the last `contention_window_s`)
has a fair share of ceil(limit / T) requests and tokens. Capacity is never
left idle: a tenant may exceed its share while nobody else waits, but once
another tenant has been refused, the room that tenant is owed is reserved
for it, and the tenant over its share is refused (RESOURCE_EXHAUSTED, retry
hint) until it drops back. So one tenant cannot starve the others.
Transport-neutral: gRPC and HTTP share one controller per process.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from cluster.orchestration.backend import BackendError, GenerateJob

_MIN_RETRY_S, _MAX_RETRY_S, _DEFAULT_RETRY_S = 0.05, 30.0, 1.0
CONTENTION_WINDOW_S = 5.0


def tenant_of(cache_salt: str | None) -> str:
    return (cache_salt or "").split("/", 1)[0]


@dataclass
class Ticket:
    request_id: str
    tokens: int
    admitted_at: float
    tenant: str = ""


@dataclass
class _Use:
    requests: int = 0
    tokens: int = 0


class AdmissionController:
    def __init__(self, max_requests: int, max_tokens: int, on_change=None, *,
                 clock: Callable[[], float] = time.monotonic,
                 contention_window_s: float = CONTENTION_WINDOW_S) -> None:
        if max_requests < 1 or max_tokens < 1:
            raise ValueError("max_queued_requests and max_queued_tokens must be >= 1")
        if contention_window_s <= 0:
            raise ValueError(f"contention_window_s must be > 0 seconds, got {contention_window_s}")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._in_flight: dict[str, Ticket] = {}
        self._tokens = 0
        self._use: dict[str, _Use] = {}
        self._refused_at: dict[str, float] = {}      # tenant -> last refusal (it is waiting for room)
        self._ema_duration: float | None = None
        self._on_change = on_change or (lambda n: None)
        self._clock = clock
        self._window = contention_window_s

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def queued_tokens(self) -> int:
        return self._tokens

    def tenant_usage(self, tenant: str) -> tuple[int, int]:
        """(requests, tokens) the tenant holds."""
        u = self._use.get(tenant, _Use())
        return u.requests, u.tokens

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
        tenant, now = tenant_of(job.cache_salt), self._clock()
        if len(self._in_flight) >= self.max_requests or self._tokens + tokens > self.max_tokens:
            self._refused_at[tenant] = now
            raise BackendError("RESOURCE_EXHAUSTED",
                               f"server busy: {len(self._in_flight)} requests / {self._tokens} tokens in "
                               f"flight (limits {self.max_requests} / {self.max_tokens}); retry later",
                               retry_after_s=self.retry_after_s())
        self._check_share(tenant, tokens, now)
        ticket = Ticket(job.request_id, tokens, now, tenant)
        self._in_flight[job.request_id] = ticket
        self._tokens += tokens
        use = self._use.setdefault(tenant, _Use())
        use.requests += 1
        use.tokens += tokens
        self._on_change(len(self._in_flight))
        return ticket

    def _check_share(self, tenant: str, tokens: int, now: float) -> None:
        waiting = {t for t, at in self._refused_at.items() if now - at <= self._window}
        for t in set(self._refused_at) - waiting:
            del self._refused_at[t]
        others = waiting - {tenant}
        if not others:
            return   # nobody else waits: use any free room
        tenants = len(others | {t for t, u in self._use.items() if u.requests} | {tenant})
        share_req, share_tok = math.ceil(self.max_requests / tenants), math.ceil(self.max_tokens / tenants)
        use = self._use.get(tenant, _Use())
        owed_req = sum(max(0, share_req - self._use.get(t, _Use()).requests) for t in others)
        owed_tok = sum(max(0, share_tok - self._use.get(t, _Use()).tokens) for t in others)
        free_req, free_tok = self.max_requests - len(self._in_flight), self.max_tokens - self._tokens
        over_req = use.requests + 1 > share_req and free_req - 1 < owed_req
        over_tok = use.tokens + tokens > share_tok and free_tok - tokens < owed_tok
        if over_req or over_tok:
            raise BackendError("RESOURCE_EXHAUSTED",
                               f"server busy: your tenant holds {use.requests} requests / {use.tokens} tokens, "
                               f"its fair share is {share_req} / {share_tok} while {tenants} tenants compete "
                               f"(limits {self.max_requests} / {self.max_tokens}); retry later",
                               retry_after_s=self.retry_after_s())

    def release(self, ticket: Ticket) -> None:
        if self._in_flight.get(ticket.request_id) is not ticket:
            return   # released already
        del self._in_flight[ticket.request_id]
        self._tokens -= ticket.tokens
        use = self._use[ticket.tenant]
        use.requests -= 1
        use.tokens -= ticket.tokens
        if not use.requests:
            del self._use[ticket.tenant]
        d = self._clock() - ticket.admitted_at
        self._ema_duration = d if self._ema_duration is None else 0.8 * self._ema_duration + 0.2 * d
        self._on_change(len(self._in_flight))

    def retry_after_s(self) -> float:
        """When a slot is likely to free up: mean duration spread over the requests in flight."""
        if self._ema_duration is None:
            return _DEFAULT_RETRY_S
        est = self._ema_duration / max(1, len(self._in_flight))
        return min(_MAX_RETRY_S, max(_MIN_RETRY_S, est))

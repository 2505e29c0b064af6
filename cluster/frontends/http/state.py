"""What the HTTP endpoint shares across requests: one object per app (no globals)."""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Iterator

from cluster.frontends.auth import ApiKeys
from cluster.observability.metrics import Metrics
from cluster.frontends.runner import RequestRunner


@dataclass
class EndpointState:
    runner: RequestRunner                  # shared with the gRPC endpoint: router, validation, admission
    metrics: Metrics
    model_name: str                        # the served name /v1/models lists and responses carry
    aliases: tuple[str, ...] = ()          # further names requests may use (--served-model-name A B ...)
    api_keys: ApiKeys | None = None
    request_timeout: float = 0.0           # seconds; 0 = no server-side deadline
    write_timeout: float = 0.0             # seconds a streamed send may wait on a client; 0 = no bound
    serving: bool = True                   # False while draining: /ready 503, new requests 503
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0
    _idle: asyncio.Event | None = None

    def serves(self, name: str) -> bool:
        return name == self.model_name or name in self.aliases

    def deadline(self) -> float | None:
        t = self.request_timeout
        return time.monotonic() + t if t > 0 and math.isfinite(t) else None

    def count(self, outcome: str) -> None:
        """pdserve_requests{outcome} for requests refused before they reach the runner."""
        self.metrics.requests.labels(outcome=outcome).inc()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count a generation response as in flight (draining waits for zero)."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and self._idle is not None:
                self._idle.set()

    async def wait_idle(self, timeout: float | None) -> bool:
        """Until no generation response is in flight; False if `timeout` passed first."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            async with asyncio.timeout(timeout):
                while self.in_flight:
                    self._idle.clear()
                    await self._idle.wait()
            return True
        except TimeoutError:
            return False

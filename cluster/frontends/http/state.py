"""What the HTTP endpoint shares across requests: one object per app (no globals).

In-flight tracking, the deadline and the metrics belong to the request runner
(shared with the gRPC endpoint when both run); this holds what only HTTP has.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from cluster.frontends.auth import ApiKeys
from cluster.frontends.runner import RequestRunner
from cluster.observability.metrics import Metrics


@dataclass
class EndpointState:
    runner: RequestRunner                  # the process's runner: validation, admission, deadline, in flight
    model_name: str                        # the served name /v1/models lists and responses carry
    aliases: tuple[str, ...] = ()          # further names requests may use (--served-model-name A B ...)
    api_keys: ApiKeys | None = None
    write_timeout: float = 0.0             # seconds a streamed send may wait on a client; 0 = no bound
    serving: bool = True                   # False while draining: /ready 503, new requests 503
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def metrics(self) -> Metrics:
        return self.runner.metrics

    def serves(self, name: str) -> bool:
        return name == self.model_name or name in self.aliases

    def count(self, outcome: str) -> None:
        """pdserve_requests{outcome} for requests refused before they reach the runner."""
        self.metrics.requests.labels(outcome=outcome).inc()

"""What arrives on one request's queue while it is decoded: typed messages, one kind each."""
from __future__ import annotations

from dataclasses import dataclass

from cluster.orchestration.backend import BackendError
from engine.outputs import StepDelta


@dataclass(frozen=True)
class Tokens:
    """A step's delta from the decode worker serving the request."""
    delta: StepDelta


@dataclass(frozen=True)
class Counted:
    """A delta already counted among the streamed tokens (a re-prefill's first token, or
    one queued before the request moved on): stream it, do not count it again."""
    delta: StepDelta


@dataclass(frozen=True)
class WorkerLost:
    """The decode worker serving the request died or became unreachable."""
    error: BackendError


@dataclass(frozen=True)
class Moved:
    """The worker `worker_id` gave the request back unstarted: it drains, or (`rebalanced`)
    another decode worker has free slots (rebalance.py)."""
    worker_id: str
    rebalanced: bool = False


Message = Tokens | Counted | WorkerLost | Moved

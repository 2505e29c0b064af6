"""The worker API, stated once: what every worker does, what a prefill worker
and a decode worker add, and how orchestration sees them through Ray.

`PrefillWorker` (prefill_worker/worker.py) and `DecodeWorker`
(decode_worker/worker.py) implement `PrefillWorkerAPI` / `DecodeWorkerAPI`;
orchestration holds Ray actor handles to them, typed `PrefillWorkerHandle` /
`DecodeWorkerHandle`: the same methods, each called `.remote(**kwargs)` and
awaited. Every method that takes arguments takes them by keyword only, and
what crosses the boundary is a frozen dataclass of worker_api/messages.py.

A hand-off, in calls (P a prefill worker, D a decode worker):
  D.reserve(item=...)                     optional: blocks for the prompt, ahead
  P.prefill(item=..., read_ahead=D)       -> PrefillResult(first, handle)
  P -> D.read_ahead(...)                  optional: completed blocks, per chunk
  D.submit(item=..., handle=..., first_token=...) -> SubmitResult (D pulls the rest)
  P.renew(...) while D waits for room; P.release(...) if D never reads.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Protocol, Sequence, TypeVar

from engine.kv_events import KVSnapshot
from engine.outputs import StepDelta
from kvtransfer.engine import PeerInfo
from kvtransfer.handle import KVHandle
from worker_api.messages import (GiveBack, IntegrityReport, LeaseCounters, PrefillResult, PullFailure,
                                 ReadyInfo, SubmitResult, WorkerReport, WorkItem)

R_co = TypeVar("R_co", covariant=True)


# ------------------------------------------------------------ the API itself
class WorkerAPI(Protocol):
    """What every worker does, whatever its role."""

    async def ready(self) -> ReadyInfo:
        """Start the engine (idempotent) and say who and where the worker is."""
        ...

    async def report(self) -> WorkerReport:
        """Load and KV events since the last report (answers at once, even mid-step)."""
        ...

    def step_trace(self) -> dict[str, Any]:
        """Engine steps timed since the last call (engine/step_trace.py), JSON-able."""
        ...

    async def kv_snapshot(self) -> KVSnapshot:
        """Every cached block hash: the router resyncs from it after an event gap."""
        ...

    async def check_integrity(self) -> IntegrityReport:
        """Raise if the engine's pools are inconsistent; else what they hold."""
        ...

    async def drain(self) -> list[str]:
        """Scale-down: take no new work; abort and return the queued, unstarted requests."""
        ...

    def undrain(self) -> None:
        """Take work again after `drain`."""
        ...

    async def abort(self, *, request_id: str) -> bool:
        """End a request wherever it is here and free its blocks."""
        ...


class ReadAheadTarget(Protocol):
    """Who a prefill worker tells of the prompt blocks completed so far (`layers`: only
    layers [l0, l1) of them, while the last chunk computes; None: whole blocks)."""

    async def read_ahead(self, *, request_id: str, peer: PeerInfo, first_index: int,
                         block_ids: tuple[int, ...], preemptions: int,
                         layers: tuple[int, int] | None = None) -> None:
        ...


class PrefillWorkerAPI(WorkerAPI, Protocol):
    """A worker that computes prompts' KV and first tokens and lends the KV under a lease."""

    async def prefill(self, *, item: WorkItem,
                      read_ahead: ReadAheadTarget | ReadAheadHandle | None = None) -> PrefillResult:
        """Compute the prompt's KV and its first token; pin the blocks for a reader."""
        ...

    async def release(self, *, request_id: str) -> bool:
        """The reader will not read (cancelled, or it recomputed): free now."""
        ...

    def renew(self, *, request_id: str, ttl: float | None = None) -> bool:
        """The reader still waits: keep the blocks pinned `ttl` seconds more."""
        ...

    def peer_info(self) -> PeerInfo:
        """Where readers reach this worker's KV."""
        ...

    def lease_counters(self) -> LeaseCounters:
        ...


class DecodeWorkerAPI(WorkerAPI, ReadAheadTarget, Protocol):
    """A worker that joins requests to its continuous batch (pulling their KV) and
    streams every engine step's tokens."""

    async def submit(self, *, item: WorkItem, handle: KVHandle | None = None, first_token: int | None = None,
                     on_pull_failure: PullFailure = PullFailure.RECOMPUTE) -> SubmitResult:
        """Join the request: pull `handle`'s blocks (with `first_token`, the token the
        prefill node sampled), or prefill it here when there is no handle."""
        ...

    async def reserve(self, *, item: WorkItem) -> bool:
        """Reserve KV blocks for a prompt being prefilled elsewhere. False: none reserved."""
        ...

    async def give_back(self, *, request_ids: Sequence[str]) -> GiveBack:
        """Of ``request_ids``, those not started here, handed back for a worker with room:
        hand-offs waiting for room (their submits return ``moved`` + ``given_back``) and
        requests queued in the engine with nothing computed (aborted here)."""
        ...

    def output_stream(self) -> AsyncIterator[list[StepDelta]]:
        """Every engine step's deltas, one list per step; the first list is empty."""
        ...


# --------------------------------------------------- the API through Ray handles
class RemoteMethod(Protocol[R_co]):
    """A worker method seen through a Ray actor handle: keywords only, awaited."""

    def remote(self, **kwargs: Any) -> Awaitable[R_co]: ...


class RemoteStream(Protocol):
    """A streaming worker method: `.options(num_returns="streaming").remote()`."""

    def options(self, **options: Any) -> Any: ...


class WorkerHandle(Protocol):
    ready: RemoteMethod[ReadyInfo]
    report: RemoteMethod[WorkerReport]
    step_trace: RemoteMethod[dict[str, Any]]
    kv_snapshot: RemoteMethod[KVSnapshot]
    check_integrity: RemoteMethod[IntegrityReport]
    drain: RemoteMethod[list[str]]
    undrain: RemoteMethod[None]
    abort: RemoteMethod[bool]


class ReadAheadHandle(Protocol):
    read_ahead: RemoteMethod[None]


class PrefillWorkerHandle(WorkerHandle, Protocol):
    prefill: RemoteMethod[PrefillResult]
    release: RemoteMethod[bool]
    renew: RemoteMethod[bool]
    peer_info: RemoteMethod[PeerInfo]
    lease_counters: RemoteMethod[LeaseCounters]


class DecodeWorkerHandle(WorkerHandle, ReadAheadHandle, Protocol):
    submit: RemoteMethod[SubmitResult]
    reserve: RemoteMethod[bool]
    give_back: RemoteMethod[GiveBack]
    output_stream: RemoteStream

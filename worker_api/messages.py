"""What crosses the Ray boundary between orchestration and a worker: small,
frozen, picklable values, each built with keyword arguments."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.engine_stats import EngineStats
from engine.kv_events import KVEvent
from engine.outputs import StepDelta
from engine.sampling_params import SamplingParams
from kvtransfer.handle import KVHandle


class PullFailure(enum.Enum):
    """What a decode worker does when a KV pull fails or times out."""
    RECOMPUTE = "recompute"   # recompute the prompt here; the request stays joined
    REPORT = "report"         # join nothing and say so: the caller prefills it elsewhere


@dataclass(frozen=True)
class WorkItem:
    """One request as a worker sees it: what prefill, reserve and submit take."""
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, tuple):   # a list would make the item unhashable
            raise ValueError("WorkItem.prompt_token_ids must be a tuple of ints: pass tuple(ids)")


@dataclass(frozen=True)
class PrefillResult:
    """The first token's delta, and the KV handle unless that token ended the request.
    `moved`: the worker did not start it (`first` is None): prefill elsewhere. It is
    draining, or (`busy`) its queue is full. The timings are None for a moved request:
    `queue_seconds` from add_request to the engine first scheduling it, `prefill_seconds`
    from the call's arrival to the first token."""
    first: StepDelta | None
    handle: KVHandle | None = None
    queue_seconds: float | None = None
    prefill_seconds: float | None = None
    moved: bool = False
    busy: bool = False   # with `moved`: its queue was full (SchedulerConfig.max_waiting)

    @property
    def first_token(self) -> int | None:
        """The token the prefill node sampled (what a decode worker's submit takes)."""
        return self.first.new_token_ids[0] if self.first is not None and self.first.new_token_ids else None


@dataclass(frozen=True)
class GiveBack:
    """What a decode worker handed back (`give_back`): hand-offs that were waiting there for
    room (their submits return `moved` + `given_back`), and requests that were queued in its
    engine with nothing computed, aborted there (their submits had returned: the caller
    continues them elsewhere)."""
    waiting_for_room: tuple[str, ...] = ()
    queued: tuple[str, ...] = ()


@dataclass(frozen=True)
class SubmitResult:
    """How the request joined a decode worker. `transferred_blocks` is 0 for a
    local prefill; `recomputed` is True when a pull failed and the prompt is
    being recomputed here."""
    local_prefill: bool
    cached_blocks: int = 0
    transferred_blocks: int = 0
    transferred_bytes: int = 0      # what the reads reported moving (reads ahead into a reservation too)
    descriptors: int = 0
    transfer_seconds: float = 0.0
    recomputed: bool = False
    error: str = ""
    joined: bool = True      # False: not in this engine (pull failed with PullFailure.REPORT, or moved)
    moved: bool = False      # the worker is draining: submit it elsewhere (the handle is still good)
    busy: bool = False       # with `moved`: its queue was full (SchedulerConfig.max_waiting)
    given_back: bool = False  # with `moved`: it waited for room and another worker has some (give_back)
    block_ids: tuple[int, ...] = ()   # the request's blocks here after the pull (for explaining it)
    room_wait_seconds: float = 0.0    # waiting here for free KV blocks before the pull
    reserved: bool = False            # its blocks were reserved ahead (`reserve`): no wait for room
    read_ahead_blocks: int = 0        # of transferred_blocks: read while the prompt was prefilled
    layer_read_ahead_blocks: int = 0  # of transferred_blocks: some layers read while the last chunk computed


@dataclass(frozen=True)
class WorkerReport:
    """A worker's periodic report: its engine's load and KV events since the last one,
    and (prefill role) its leases."""
    worker_id: str
    pool: str
    stats: EngineStats
    events: tuple[KVEvent, ...]
    leases_active: int = 0          # prefill role: blocks pinned for readers
    lease_expiries: int = 0         # prefill role: cumulative leases that expired unread
    reservation_expiries: int = 0   # decode role: cumulative reservations no submit claimed in time


@dataclass(frozen=True)
class LeaseCounters:
    """A prefill worker's lease table: pinned == active + expired + notified + released."""
    active: int
    expired: int
    notified: int
    released: int
    pinned: int = 0      # ever pinned
    renewed: int = 0


@dataclass(frozen=True)
class ReadyInfo:
    """What a worker says once its model is loaded (the launcher logs it as a dict)."""
    worker_id: str
    pool: str                       # "prefill" | "decode" | "colocated"
    pid: int
    niceness: int
    address: str                    # the address its KV side channel binds
    hostname: str
    num_blocks: int
    block_size: int
    kv_cache_dtype: str
    kv_bytes_per_block: int
    backend: str | None = None      # its transfer backend; None: it moves no KV (colocated)
    kv_port: int | None = None      # the port readers reach its KV on (prefill role)
    tensor_parallel_size: int = 1   # ranks (Ray actors) its model is split over
    kv_bytes_per_head_block: int = 0   # one KV head's share of a block (equal across TP sizes)


@dataclass(frozen=True)
class IntegrityReport:
    """A worker's pools passed their integrity check; what they hold now."""
    kv_blocks_used: int
    running: int
    waiting: int
    held: int                       # prefill role: finished prompts holding blocks for a reader
    leases: int = 0                 # prefill role: leases still active


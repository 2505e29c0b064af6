"""What the cluster did with each request, for operators and tests: recovery counters
(typed, one per `Recovery` kind) and a bounded log of events per request (route, prefill,
hand-off, join, migrations), also logged on `pdserve.requests` at DEBUG
(`--log-level INFO,pdserve.requests=DEBUG`)."""
from __future__ import annotations

import collections
import enum
import logging
from dataclasses import dataclass, fields

EVENT_LOG_LEN = 100_000
trace_log = logging.getLogger("pdserve.requests")


class Recovery(enum.Enum):
    """Something that kept a request going; its value names the counter."""
    MIGRATION = "migrations"              # decode node died: continued on another one
    MOVED = "moved"                       # a draining worker handed a queued request back
    PREFILL_LOST = "prefill_lost"         # a prefill call failed: the node died or is unreachable
    TRANSFER_FAILURE = "transfer_failures"  # a KV pull failed or timed out
    RECOMPUTED = "recomputed"             # ... then recomputed on the decode node
    REPREFILLED = "reprefilled"           # ... then prefilled again on another prefill node
    NO_KV_ROOM = "no_kv_room"             # no KV room on the decode node within transfer_timeout
    BUSY = "busy"                         # a worker's queue was full (max_worker_queue)
    REBALANCED = "rebalanced"             # waited for room on a decode worker, moved to one with room
    LEASE_RENEWAL = "lease_renewals"      # the frontend renewed a prefill node's lease


@dataclass(frozen=True)
class RecoveryCounters:
    """Cumulative per frontend process: a snapshot (`Journal.counters`)."""
    migrations: int = 0
    moved: int = 0
    prefill_lost: int = 0
    transfer_failures: int = 0
    recomputed: int = 0
    reprefilled: int = 0
    no_kv_room: int = 0
    busy: int = 0
    rebalanced: int = 0
    lease_renewals: int = 0


assert {f.name for f in fields(RecoveryCounters)} == {r.value for r in Recovery}


class Journal:
    def __init__(self, max_events: int = EVENT_LOG_LEN) -> None:
        self._counts: collections.Counter[Recovery] = collections.Counter()
        self.events: collections.deque[tuple[str, str]] = collections.deque(maxlen=max_events)

    @property
    def counters(self) -> RecoveryCounters:
        return RecoveryCounters(**{kind.value: n for kind, n in self._counts.items()})

    def note(self, request_id: str, kind: Recovery, *, count_only: bool = False) -> None:
        self._counts[kind] += 1
        if not count_only:
            self.events.append((client_id(request_id), kind.value))

    def trace(self, request_id: str, text: str) -> None:
        """What the cluster did with a request (route, hand-off, join)."""
        self.events.append((client_id(request_id), text))
        trace_log.debug("%s: %s", request_id, text)

    def request_events(self, request_id: str) -> list[str]:
        """What happened to a request (recent ones): migrations, moves, recomputes, its trace."""
        rid = client_id(request_id)
        return [kind for r, kind in self.events if r == rid]


def attempt_id(request_id: str, attempt: int) -> str:
    """Workers know each attempt of a request by its own id: a continuation never meets
    what a worker still holds of an earlier attempt (a held prefill, a late read
    notification). The space cannot occur in a client's id (validation)."""
    return f"{client_id(request_id)} ~{attempt}"


def client_id(request_id: str) -> str:
    return request_id.split(" ", 1)[0]


def describe_decision(decision) -> str:
    return (f"routed {decision.kind.value}, prefill {decision.prefill_worker_id}, "
            f"decode {decision.decode_worker_id}")


def describe_submit(sub) -> str:
    parts = ["local prefill" if sub.local_prefill else f"{sub.cached_blocks} blocks cached, "
             f"{sub.transferred_blocks} pulled", f"blocks {list(sub.block_ids)}"]
    if sub.read_ahead_blocks or sub.layer_read_ahead_blocks:
        parts.append(f"{sub.read_ahead_blocks} read ahead whole, {sub.layer_read_ahead_blocks} by layer group")
    if sub.recomputed:
        parts.append("recomputed")
    if sub.moved:
        parts.append("moved")
    if sub.error:
        parts.append(f"error {sub.error!r}")
    return ", ".join(parts)

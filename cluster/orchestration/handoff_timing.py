"""The hand-off gap, measured: from the first token (the prefill node's) to the second (the
decode node's), by stage, into `pdserve_handoff_seconds{stage}` and the request's trace;
and each pull's transfer figures.

Stages, from the first token reaching the frontend: `join` (the decode node's submit
returned; of it `room` and `pull`), `admit` (the decode node reported the request in
its running batch), `hold` (the first token released to the client: ~0 unless
`first_token_release: decode`), `first_step` (join to the second token), `client_gap`
(released first token to the second: the gap the client sees), `total`."""
from __future__ import annotations

import time
from dataclasses import dataclass

from cluster.observability.metrics import Metrics


@dataclass
class HandoffClock:
    """When a request's first token left the prefill node, when the decode node joined it,
    and what that join cost: the second token then closes the hand-off gap."""
    first_token_at: float
    joined_at: float = 0.0
    admitted_at: float = 0.0   # the decode node's admission reached the frontend
    released_at: float = 0.0   # the first token went to the client
    room_s: float = 0.0
    pull_s: float = 0.0
    reserved: bool = False   # the decode blocks were reserved during the prefill

    def joined(self, sub) -> None:
        """The decode node's submit returned having pulled the KV."""
        self.joined_at, self.room_s, self.pull_s = time.monotonic(), sub.room_wait_seconds, sub.transfer_seconds
        self.reserved = sub.reserved

    def admitted(self) -> None:
        self.admitted_at = self.admitted_at or time.monotonic()

    def released(self) -> float:
        """The first token goes to the client now: seconds it was held."""
        self.released_at = time.monotonic()
        return self.released_at - self.first_token_at

    def stages(self) -> dict[str, float] | None:
        """Seconds per stage, now that the second token arrived; None without a clean join
        (the submit did not pull: recomputed, moved)."""
        if not self.joined_at:
            return None
        now, released = time.monotonic(), self.released_at or self.first_token_at
        stages = {"join": self.joined_at - self.first_token_at, "room": self.room_s, "pull": self.pull_s}
        if self.admitted_at:
            stages["admit"] = self.admitted_at - self.first_token_at
        return stages | {"hold": released - self.first_token_at, "first_step": now - self.joined_at,
                         "client_gap": now - released, "total": now - self.first_token_at}


def observe_handoff(metrics: Metrics, clock: HandoffClock) -> str | None:
    """Record the gap's stages; the trace line to keep, or None."""
    stages = clock.stages()
    if stages is None:
        return None
    for stage, seconds in stages.items():
        metrics.handoff.labels(stage=stage).observe(max(0.0, seconds))
    return ("second token " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in stages.items())
            + (" (blocks reserved ahead)" if clock.reserved else ""))


def observe_transfer(metrics: Metrics, sub) -> None:
    if sub.error and not sub.local_prefill:   # a failed or timed-out pull (not "no KV room")
        metrics.transfer_failures.inc()
    if sub.transferred_blocks:
        metrics.transfer_seconds.observe(sub.transfer_seconds)
        metrics.transfer_bytes.observe(sub.transferred_bytes)
        metrics.transfer_blocks.inc(sub.transferred_blocks)

"""The hand-off gap, measured: from the first token (the prefill node's) to the second (the
decode node's), by stage, into `pdserve_handoff_seconds{stage}` and the request's trace;
and each pull's transfer figures."""
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
    room_s: float = 0.0
    pull_s: float = 0.0
    reserved: bool = False   # the decode blocks were reserved during the prefill

    def joined(self, sub) -> None:
        """The decode node's submit returned having pulled the KV."""
        self.joined_at, self.room_s, self.pull_s = time.monotonic(), sub.room_wait_seconds, sub.transfer_seconds
        self.reserved = sub.reserved

    def stages(self) -> dict[str, float] | None:
        """Seconds per stage, now that the second token arrived; None without a clean join
        (the submit did not pull: recomputed, moved)."""
        if not self.joined_at:
            return None
        now = time.monotonic()
        return {"join": self.joined_at - self.first_token_at, "room": self.room_s, "pull": self.pull_s,
                "first_step": now - self.joined_at, "total": now - self.first_token_at}


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

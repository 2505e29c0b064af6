"""A hand-off's decode KV blocks reserved while its prompt is prefilled, as the live
cluster does by default (`ServeConfig.reserve_decode_blocks`;
cluster/orchestration/reservation.py and `DecodeWorker.reserve`):

- when the router picks the decode node, the decode node runs
  `add_remote_request` for the prompt (no first token yet) between its steps:
  the prompt's blocks it does not cache are allocated and the request takes a
  sequence slot (it waits for its KV); no room: nothing is reserved and the join
  after the prefill allocates (and waits for room) as without a reservation;
- the join after the prefill claims the blocks and pulls at once (the live
  submit waits for the reserve call first: a reserve still in the decode node's
  inbox runs before the join);
- a reservation no join claims is freed: when the first token ends the request,
  and after `RESERVATION_TTL_FACTOR` transfer timeouts (the decode worker's
  expiry; the join then allocates anew, once the expiry's abort has run: a
  join that came meanwhile waits for it, as the decode worker's submit does).

The decode node's load report then counts the reserved blocks as used (its KV
manager holds them), as the live worker's report does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from engine.request import Request
from engine.scheduler import RemoteAllocation

if TYPE_CHECKING:
    from cluster.tools.sim.events import EventLoop
    from cluster.tools.sim.node import SimNode

# decode_worker/worker.py's (tests/unit/test_sim_reservation.py keeps them equal)
RESERVATION_TTL_FACTOR = 6


class Reservable(Protocol):
    """What a reservation needs of a live request (cluster_sim._Live)."""
    reservation: RemoteAllocation | None     # blocks held on its decode node, not yet claimed
    reserving: bool                          # the reserve call waits in the decode node's inbox
    expiring: bool                           # expired unclaimed: its abort waits in the decode node's inbox

    @property
    def request_id(self) -> str: ...


class Reservations:
    """Every reservation of one simulated cluster, and counts of what became of them."""

    def __init__(self, loop: EventLoop, ttl_s: float, make_request: Callable[[Reservable], Request]) -> None:
        if ttl_s <= 0:
            raise ValueError(f"a reservation's lifetime must be > 0 s (transfer_timeout_s x "
                             f"{RESERVATION_TTL_FACTOR}), got {ttl_s}")
        self.loop, self.ttl_s, self.make_request = loop, ttl_s, make_request
        self.counts = {"made": 0, "refused": 0, "claimed": 0, "freed": 0, "expired": 0}
        self.joins_held = 0       # joins that came while their reservation's expiry was freeing it

    def expiring(self, live: Reservable) -> bool:
        """The join must wait: ``live``'s reservation expired and the decode node has not run the
        abort yet (the request id is still in use there; the abort's post runs the join again)."""
        if live.expiring:
            self.joins_held += 1
        return live.expiring

    def start(self, dn: SimNode, live: Reservable) -> None:
        """The router chose ``dn`` for ``live``'s hand-off: reserve there, between its steps."""
        live.reserving = True
        dn.post(lambda n: self._reserve(n, live), keeps_batch=True)

    def _reserve(self, dn: SimNode, live: Reservable) -> None:
        if not live.reserving:                # already run (by the join), or freed before it ran
            return
        live.reserving = False
        alloc = dn.scheduler.add_remote_request(self.make_request(live))
        if alloc is None:
            self.counts["refused"] += 1
            return
        live.reservation = alloc
        self.counts["made"] += 1
        self.loop.after(self.ttl_s, self._expire, dn, live, alloc)

    def claim(self, dn: SimNode, live: Reservable) -> RemoteAllocation | None:
        """The join after the prefill: the reserved blocks (None: none held)."""
        if live.reserving:
            self._reserve(dn, live)
        alloc, live.reservation = live.reservation, None
        if alloc is not None:
            self.counts["claimed"] += 1
        return alloc

    def free(self, dn: SimNode, live: Reservable) -> None:
        """No join follows (the first token ended the request): free what is held."""
        live.reserving = False
        if live.reservation is not None:
            live.reservation = None
            self.counts["freed"] += 1
            self._abort(dn, live.request_id)

    def _expire(self, dn: SimNode, live: Reservable, alloc: RemoteAllocation) -> None:
        if live.reservation is alloc:         # never claimed
            live.reservation = None
            self.counts["expired"] += 1
            live.expiring = True              # a join meanwhile waits for the abort (its id is still in use)
            self._abort(dn, live.request_id, live)

    @staticmethod
    def _abort(dn: SimNode, request_id: str, expiring: Reservable | None = None) -> None:
        def abort(node: SimNode) -> None:
            node.scheduler.abort_request(request_id)
            if expiring is not None:
                expiring.expiring = False
        dn.post(abort, retry=True)            # then the joins waiting there (for room, or for this) retry

"""`NativeDecisions`: a whole routing decision in one C call (csrc/decide.c), for the Router.

With the default policy (``prefix_aware``) at temperature 0, the index's C
table and the in-flight tracker's C table (or tracking off), ``Router.route``
hands the prompt's hashes to ``routerfast.Decider.decide``: the in-flight
match, the index walk, every worker's cost, both argmins, the conditional
disaggregation, the optimistic load additions and the in-flight record
happen in C, and the decision's records come back built. The per-worker load
lives in the decider's arrays: a load report is one ``set_load`` call when
it arrives, a change of the live workers one ``set_roles`` call; nothing is
marshalled per decision. The Python path (router.py, policy.py) answers the
same (tests/unit/test_router_decider.py compares them decision by decision);
it serves the other policies, a positive temperature, a host without a C
compiler (``PDSERVE_ROUTER_NATIVE=0``), and takes over for good, the
optimistic additions copied back (``pending``), when a table turns itself
off (a 65th worker, a hash that is not a 64-bit unsigned int).
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Iterable

from cluster.router import native
from cluster.router.index import MatchInfo, PrefixIndex
from cluster.router.inflight import InFlightPrefixes, NoInFlightPrefixes
from cluster.router.policy import (ClusterView, CostInputs, DecisionKind, PolicyConfig, PrefixAwarePolicy,
                                   RoutingDecision, RoutingPolicy, RoutingRequest, WorkerLoad, WorkerView)


def _layout(cls: type) -> tuple[type, tuple[str, ...]]:
    return cls, tuple(f.name for f in dataclasses.fields(cls))


class NativeDecisions:
    """The decider and what it needs kept in step: worker id -> slot, index bits -> slots."""

    def __init__(self, core: native.Decider, index: PrefixIndex,
                 in_flight: InFlightPrefixes | NoInFlightPrefixes) -> None:
        self._core = core
        self._index, self._table = index, index.native_table
        self._in_flight = in_flight
        self._flight_table = in_flight.table if isinstance(in_flight, InFlightPrefixes) else None
        self._ids = index.bit_ids
        self._bits = 0                                  # index bits passed to the decider so far
        self._slots: dict[str, int] = {}

    @classmethod
    def make(cls, config: PolicyConfig, policy: RoutingPolicy, pending_ttl_s: float, index: PrefixIndex,
             in_flight: InFlightPrefixes | NoInFlightPrefixes) -> "NativeDecisions | None":
        """One for this router where the C path can decide as the Python one does, else None."""
        w = config.weights
        weights = (w.uncached_token, w.queued_token, w.running, w.kv_usage, w.transfer_block, w.host_hit,
                   w.disk_hit, w.in_flight_hit, w.busy_pool_miss, w.min_hit_share)
        flight = in_flight.table if isinstance(in_flight, InFlightPrefixes) else None
        if (type(policy) is not PrefixAwarePolicy or config.temperature != 0 or index.native_table is None
                or (flight is None and not isinstance(in_flight, NoInFlightPrefixes))
                or not all(type(x) is float for x in weights)):     # int weights: Python's int arithmetic
            return None
        ttl = in_flight.ttl_s if isinstance(in_flight, InFlightPrefixes) else 1.0
        epochs = in_flight.epochs if isinstance(in_flight, InFlightPrefixes) else None
        records = (_layout(RoutingDecision), _layout(CostInputs), _layout(MatchInfo), _layout(WorkerLoad),
                   policy.name, DecisionKind.LOCAL_PREFILL, DecisionKind.REMOTE_PREFILL)
        core = native.decider(index.native_table, flight, epochs, weights, config.local_prefill_threshold,
                              float(config.local_prefill_hit_ratio), config.colocated, float(pending_ttl_s),
                              float(ttl), records)
        return None if core is None else cls(core, index, in_flight)

    # ---- kept in step by the Router ---------------------------------------
    def add(self, worker_id: str) -> None:
        flight = self._in_flight.number(worker_id) if self._flight_table is not None else -1  # type: ignore[union-attr]
        self._slots[worker_id] = slot = self._core.add(worker_id, flight)
        bit = self._index.bit_of(worker_id)
        if bit is not None and bit < self._bits:
            self._core.set_bit(bit, slot)

    def remove(self, worker_id: str) -> None:
        self._core.remove(self._slots.pop(worker_id))

    def set_load(self, worker_id: str, load: WorkerLoad) -> None:
        self._core.set_load(self._slots[worker_id], load.queued_prefill_tokens, load.running, load.waiting,
                            float(load.kv_usage))

    def set_roles(self, prefill: Iterable[str], decode: Iterable[str]) -> None:
        slots = self._slots
        self._core.set_roles([slots[w] for w in prefill], [slots[w] for w in decode])

    def current(self) -> bool:
        """Whether the tables are still the C ones (else the Python path takes over for good);
        index bits given since the last call are passed on."""
        if self._index.native_table is not self._table or (
                self._flight_table is not None and self._in_flight.table is not self._flight_table):  # type: ignore[union-attr]
            return False
        if len(self._ids) != self._bits:
            for bit in range(self._bits, len(self._ids)):
                self._core.set_bit(bit, self._slots.get(self._ids[bit], -1))
            self._bits = len(self._ids)
        return True

    # ---- decisions and reads ----------------------------------------------
    def decide(self, req: RoutingRequest, now: float) -> RoutingDecision | None:
        """The decision (None: no live decode worker); OverflowError, nothing changed, for a
        hash the tables cannot hold."""
        hashes = req.block_hashes
        tie = 0 if hashes else zlib.crc32(req.request_id.encode())       # policy._tie_start's key
        return self._core.decide(hashes, req.prompt_tokens, req.block_size, req.request_id, tie, now)

    def view(self, live: Iterable[tuple[str, str]]) -> ClusterView:
        """The router's view of these live (worker, pool) pairs, in order: each load as reported
        plus the optimistic additions, and the tokens assigned to each."""
        core, slots = self._core, self._slots
        views = [WorkerView(w, pool, WorkerLoad(*core.load(slots[w]), True), core.assigned(slots[w]))
                 for w, pool in live]
        return ClusterView(tuple(v for v in views if v.pool == "prefill"),
                           tuple(v for v in views if v.pool != "prefill"))

    def pending(self, worker_id: str) -> tuple[int, int, float | None]:
        """The worker's optimistic additions: (tokens, running sequences, lapse time)."""
        return self._core.pending(self._slots[worker_id])

    def assigned(self, worker_id: str) -> int:
        """Prompt tokens routed to the worker to compute since it was added (the prefill tie-break)."""
        return self._core.assigned(self._slots[worker_id])

    def next_expiry(self) -> float | None:
        return self._core.next_expiry()

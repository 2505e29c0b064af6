"""`Router`: the prefix index, a load view, and a policy, behind one object.

The frontend computes a prompt's chained block hashes once and calls
``route()``; workers' KV events go to ``on_events()`` (on a gap, fetch a
``KVSnapshot`` from that worker and call ``on_snapshot()``); load reports go
to ``update_load()`` / ``observe_stats()``; a dead worker to
``on_worker_dead()``; the end of a routed request's prefill (computed, or
failed / aborted / given back) to ``on_prefill_end()``: until then its
prefix counts as in flight on the node (sends.py). Single-threaded: call it
from one event loop.

Optimistic accounting: between two load reports, each routed request adds its
uncached tokens to the queued prefill tokens of the node that prefills it,
and one running sequence to its decode node, so a burst does not pile onto
the node that looked idle in the last report. A load report replaces these
additions; without one they lapse after ``pending_ttl_s`` (injected clock).

With the default policy at temperature 0 a decision is one C call
(native_router.py): the loads, these additions included, then live in the C
decider's arrays (a report is written there when it comes) and ``view`` is
read back from them; the Python path below decides otherwise, the same way.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from cluster.router.inflight import InFlightPrefixes, NoInFlightPrefixes
from cluster.router.index import ApplyResult, PrefixIndex
from cluster.router.load import LoadReport, LoadSlot, load_from_stats
from cluster.router.native_router import NativeDecisions
from cluster.router.policy import (NO_DECODE_WORKER, POOLS, ClusterView, NoWorkerAvailable, PolicyConfig,
                                   RoutingDecision, RoutingRequest, WorkerLoad, WorkerView, make_policy)
from cluster.router.sends import OpenSends
from engine.kv_events import KVEvent, KVEventKind, KVSnapshot


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "prefix_aware"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    pending_ttl_s: float = 5.0             # optimistic additions lapse without a load report
    in_flight_ttl_s: float = 10.0          # a prefix sent to a node counts there this long after it was
                                           # sent, or last refreshed while its prefill is pending (sends.py)
    # a send whose end (on_prefill_end) never comes is kept in flight this long at most; the cluster
    # passes request_timeout: no request, and so no prefill, is pending longer
    in_flight_max_s: float = 600.0
    track_in_flight: bool = True           # count sent-but-unreported prefixes (False: NoInFlightPrefixes)

    def __post_init__(self) -> None:
        if self.pending_ttl_s <= 0 or self.in_flight_ttl_s <= 0 or self.in_flight_max_s <= 0:
            raise ValueError(f"pending_ttl_s ({self.pending_ttl_s}), in_flight_ttl_s ({self.in_flight_ttl_s}) "
                             f"and in_flight_max_s ({self.in_flight_max_s}) must be positive seconds")



class Router:
    def __init__(self, config: RouterConfig, *, rng: random.Random, clock: Callable[[], float],
                 index: PrefixIndex | None = None, native_decisions: bool = True) -> None:
        """``native_decisions``: decide in one C call where it can (native_router.py); False:
        the Python policy decides (the same decisions; tests compare them)."""
        self.config = config
        self.index = index if index is not None else PrefixIndex()
        self.policy = make_policy(config.policy, config.policy_config, rng)
        self.in_flight = (InFlightPrefixes(config.in_flight_ttl_s) if config.track_in_flight
                          else NoInFlightPrefixes())
        self._sends = (OpenSends(self.in_flight, config.in_flight_max_s)
                       if isinstance(self.in_flight, InFlightPrefixes) else None)
        self._clock = clock
        self._slots: dict[str, LoadSlot] = {}
        self._order: list[str] = []            # worker ids, sorted
        self._view: ClusterView | None = None  # None: rebuild from the slots
        self._pos: dict[str, tuple[str, int]] = {}   # worker in view -> (role, position)
        self._next_expiry: float | None = None
        # the whole decision in C where it can be (native_router.py); it then holds the pending loads
        self._fast = NativeDecisions.make(config.policy_config, self.policy, config.pending_ttl_s,
                                          self.index, self.in_flight) if native_decisions else None

    # ---- workers and load -----------------------------------------------
    def add_worker(self, worker_id: str, pool: str) -> None:
        if pool not in POOLS:
            raise ValueError(f"worker {worker_id!r}: pool must be one of {POOLS}, got {pool!r}")
        slot = self._slots.get(worker_id)
        if slot is not None:
            if slot.pool != pool:
                raise ValueError(f"worker {worker_id!r} is registered in pool {slot.pool!r}, not "
                                 f"{pool!r}: give each worker one id per pool")
            return
        self._slots[worker_id] = LoadSlot(worker_id, pool)
        bisect.insort(self._order, worker_id)
        self._view = None
        if self._fast is not None:
            self._fast.add(worker_id)
            self._fast_roles()

    def update_load(self, worker_id: str, load: WorkerLoad) -> None:
        slot = self._slot(worker_id)
        if self._fast is not None:
            was_alive, slot.reported, self._view = slot.reported.alive, load, None
            self._fast.set_load(worker_id, load)
            if load.alive != was_alive:
                self._fast_roles()
            return
        if load == slot.reported and slot.pending_until is None and not (slot.pending_tokens or
                                                                         slot.pending_running):
            return      # the same report again, nothing optimistic to clear: the view stays
        slot.reported = load
        slot.clear_pending()
        self._refresh(slot)

    def observe_stats(self, stats: LoadReport, queued_prefill_tokens: int = 0) -> None:
        """Register (if new) and update a worker from its periodic stats report."""
        self.add_worker(stats.worker_id, stats.pool)
        self.update_load(stats.worker_id, load_from_stats(stats, queued_prefill_tokens))

    def on_worker_dead(self, worker_id: str) -> None:
        """Drop the worker's index entries and stop routing to it until it reports again."""
        self.index.remove_worker(worker_id)
        self.in_flight.drop_worker(worker_id)
        if self._sends is not None:
            self._sends.worker_gone(worker_id)
        slot = self._slots.get(worker_id)
        if slot is not None:
            self.update_load(worker_id, replace(slot.reported, alive=False))

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker that left its pool for good (scale-in)."""
        self.on_worker_dead(worker_id)
        if self._slots.pop(worker_id, None) is not None:
            self._order.remove(worker_id)
            self._view = None
            if self._fast is not None:
                self._fast.remove(worker_id)
                self._fast_roles()

    # ---- KV events ------------------------------------------------------
    def on_events(self, worker_id: str, events: Iterable[KVEvent]) -> ApplyResult:
        """Apply a worker's events; on ``needs_resync`` fetch its snapshot for ``on_snapshot``.
        REMOVED / CLEARED also drop what was sent to the worker and not yet reported."""
        if not isinstance(events, (list, tuple)):
            events = list(events)
        result = self.index.apply(worker_id, events)
        for ev in events:
            if ev.kind is KVEventKind.REMOVED:
                self.in_flight.on_removed(worker_id, ev.block_hashes)
            elif ev.kind is KVEventKind.CLEARED:
                self.in_flight.drop_worker(worker_id)
                if self._sends is not None:
                    self._sends.worker_gone(worker_id)
        return result

    def on_snapshot(self, worker_id: str, snapshot: KVSnapshot) -> None:
        self.index.resync(worker_id, snapshot)

    # ---- routing --------------------------------------------------------
    def on_prefill_end(self, request_id: str, computed: bool = True) -> bool:
        """The routed request's prefill ended: its in-flight record is no longer kept alive and
        lapses (``computed``: the node reports the blocks), or goes now (failed, aborted, given
        back unstarted). False: no open send of that id (ended already, lapsed, or not tracked)."""
        return self._sends is not None and self._sends.ended(request_id, computed)

    @property
    def open_sends(self) -> int:
        """Routed requests whose prefill end has not reached the router (their prefixes kept in flight)."""
        return 0 if self._sends is None else len(self._sends)

    def route(self, request: RoutingRequest) -> RoutingDecision:
        now = self._clock()
        sends = self._sends
        if sends is not None:
            sends.keep_alive(now)
        decision = self._decide(request, now)
        if sends is not None:
            sends.opened(request.request_id, decision.prefill_worker_id or decision.decode_worker_id,
                         request.block_hashes, now)
        return decision

    def _decide(self, request: RoutingRequest, now: float) -> RoutingDecision:
        fast = self._fast
        if fast is not None:
            if fast.current():
                try:
                    decision = fast.decide(request, now)
                except OverflowError:              # a hash the C tables cannot hold: Python from now on
                    self._leave_fast()
                else:
                    self._view = None
                    if decision is None:
                        raise NoWorkerAvailable(NO_DECODE_WORKER)
                    return decision
            else:
                self._leave_fast()
        if self._next_expiry is not None and now >= self._next_expiry:
            self._expire(now)
        decision = self.policy.route(request, self.view, self.index,
                                     self.in_flight.match(request.block_hashes, now))
        self._account(request, decision, now)
        self.in_flight.record(decision.prefill_worker_id or decision.decode_worker_id,
                              request.block_hashes, now)
        return decision

    @property
    def view(self) -> ClusterView:
        if self._view is None and self._fast is not None:
            self._view = self._fast.view([(w, self._slots[w].pool) for w in self._order
                                          if self._slots[w].reported.alive])
        if self._view is None:
            live = [self._slots[w].view for w in self._order if self._slots[w].view.load.alive]
            prefill = tuple(v for v in live if v.pool == "prefill")
            decode = tuple(v for v in live if v.pool != "prefill")
            self._pos = {v.worker_id: ("prefill", i) for i, v in enumerate(prefill)}
            self._pos.update({v.worker_id: ("decode", i) for i, v in enumerate(decode)})
            self._view = ClusterView(prefill, decode)
            self.policy.sync(self._view)
        return self._view

    def _refresh(self, *slots: LoadSlot) -> None:
        """Rebuild these workers' views; patch them into the cluster view in place
        when their liveness is unchanged (the per-decision path: one new
        ClusterView for both workers of a decision), else rebuild."""
        view, patched = self._view, []
        for slot in slots:
            was_alive = slot.view.load.alive
            slot.refresh()
            pos = self._pos.get(slot.worker_id)
            if view is None or pos is None or not was_alive or not slot.view.load.alive:
                view = None
            else:
                patched.append((pos, slot.view))
        if view is None:
            self._view = None
            return
        prefill, decode = view.prefill, view.decode
        for (role, i), v in patched:
            if role == "prefill":
                prefill = prefill[:i] + (v,) + prefill[i + 1:]
            else:
                decode = decode[:i] + (v,) + decode[i + 1:]
        self._view = view = ClusterView(prefill, decode)
        for _, v in patched:
            self.policy.update(v, view)

    def _account(self, req: RoutingRequest, d: RoutingDecision, now: float) -> None:
        until = now + self.config.pending_ttl_s
        prefill = self._slots[d.prefill_worker_id or d.decode_worker_id]
        decode = self._slots[d.decode_worker_id]
        prefill.pending_tokens += req.prompt_tokens - d.prefill_cached_tokens
        prefill.assigned_tokens += req.prompt_tokens - d.prefill_cached_tokens
        decode.pending_running += 1
        for slot in (prefill, decode):
            if slot.pending_until is None:
                slot.pending_until = until
        if prefill is decode:
            self._refresh(decode)
        else:
            self._refresh(prefill, decode)
        if self._next_expiry is None:
            self._next_expiry = until

    def _expire(self, now: float) -> None:
        nxt = None
        for slot in self._slots.values():
            if slot.pending_until is None:
                continue
            if slot.pending_until <= now:
                slot.clear_pending()
                self._refresh(slot)
            elif nxt is None or slot.pending_until < nxt:
                nxt = slot.pending_until
        self._next_expiry = nxt

    def _fast_roles(self) -> None:
        """The live workers by role, in the view's order, to the C decider."""
        assert self._fast is not None
        live = [w for w in self._order if self._slots[w].reported.alive]
        self._fast.set_roles([w for w in live if self._slots[w].pool == "prefill"],
                             [w for w in live if self._slots[w].pool != "prefill"])

    def _leave_fast(self) -> None:
        """The Python path decides from now on: the C decider's pending loads and assigned
        tokens copied back."""
        fast, self._fast, self._view = self._fast, None, None
        assert fast is not None
        for worker_id, slot in self._slots.items():
            slot.pending_tokens, slot.pending_running, slot.pending_until = fast.pending(worker_id)
            slot.assigned_tokens = fast.assigned(worker_id)
            slot.refresh()
        self._next_expiry = fast.next_expiry()

    def _slot(self, worker_id: str) -> LoadSlot:
        slot = self._slots.get(worker_id)
        if slot is None:
            raise ValueError(f"unknown worker {worker_id!r}: call add_worker(worker_id, pool) first")
        return slot

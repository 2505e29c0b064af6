"""Routing policies: an abstract `RoutingPolicy` plus named implementations.

Every policy shares one skeleton (``RoutingPolicy.route``): match the prompt
against the index, pick a decode node, apply conditional disaggregation
(the decode node prefills itself when what it lacks is short or it holds most
of the prompt), otherwise pick a prefill node. In colocated mode one
decode-capable worker does both phases. Policies differ only in how they
pick: ``prefix_aware`` (default) by the cost in cost.py, ``round_robin`` in
turn, ``least_loaded`` by load alone. ``make_policy(name, ...)`` builds one.
"""
from __future__ import annotations

import abc
import random
import zlib
from dataclasses import dataclass, field
from enum import Enum
from operator import add
from types import MappingProxyType
from typing import Callable, ClassVar, Iterable, Mapping, MutableMapping, Sequence

import numpy as np

from cluster.router import cost as C
from cluster.router.cost_vector import LIST_MAX, RoleCosts
from cluster.router.inflight import InFlightMatch
from cluster.router.index import Matches, MatchInfo, PrefixIndex

POOLS = ("prefill", "decode", "colocated")
NO_MATCH = MatchInfo(0)


class NoWorkerAvailable(RuntimeError):
    """No live worker can take the request (map to gRPC UNAVAILABLE)."""


NO_DECODE_WORKER = "no live decode worker: wait for one to report, or start decode workers (--decode-workers)"


class DecisionKind(str, Enum):
    REMOTE_PREFILL = "remote_prefill"
    LOCAL_PREFILL = "local_prefill"


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    request_id: str
    prompt_tokens: int
    block_hashes: tuple[int, ...]          # engine.block_hash.block_hashes(...) of the prompt
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.prompt_tokens <= 0:
            raise ValueError(f"request {self.request_id!r}: prompt_tokens must be >= 1")
        if len(self.block_hashes) > self.prompt_tokens // self.block_size:
            raise ValueError(f"request {self.request_id!r}: {len(self.block_hashes)} block hashes "
                             f"for {self.prompt_tokens} tokens of block size {self.block_size}; "
                             "pass only the hashes of full blocks")


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    queued_prefill_tokens: int = 0         # prompt tokens waiting to be prefilled on the node
    running: int = 0                       # sequences in the decode batch
    waiting: int = 0
    kv_usage: float = 0.0                  # used / total KV blocks
    alive: bool = True

    def __post_init__(self) -> None:
        if self.queued_prefill_tokens < 0 or self.running < 0 or self.waiting < 0 or self.kv_usage < 0:
            raise ValueError(f"WorkerLoad fields must be >= 0, got {self}")


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: str
    pool: str                              # "prefill" | "decode" | "colocated"
    load: WorkerLoad
    assigned_tokens: int = 0               # prompt tokens this router sent it to compute (since added)

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"worker {self.worker_id!r}: pool must be one of {POOLS}, got {self.pool!r}")


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Live workers by role, each in a stable order (by worker id)."""
    prefill: tuple[WorkerView, ...]        # pool "prefill"
    decode: tuple[WorkerView, ...]         # pools "decode" and "colocated"

    @classmethod
    def of(cls, workers: Iterable[WorkerView]) -> "ClusterView":
        live = sorted((w for w in workers if w.load.alive), key=lambda w: w.worker_id)
        return cls(prefill=tuple(w for w in live if w.pool == "prefill"),
                   decode=tuple(w for w in live if w.pool != "prefill"))


@dataclass(frozen=True, slots=True)
class CostInputs:
    """What a choice was based on, for logging."""
    worker_id: str
    match: MatchInfo
    load: WorkerLoad
    cost: float
    candidates: int


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    request_id: str
    policy: str
    kind: DecisionKind
    decode_worker_id: str
    prefill_worker_id: str | None          # None: the decode node prefills locally
    prefill_cached_tokens: int             # expected cached tokens where prefill runs
    decode_cached_tokens: int              # expected cached tokens on the decode node
    decode_inputs: CostInputs
    prefill_inputs: CostInputs | None = None


@dataclass(frozen=True)
class PolicyConfig:
    temperature: float = 0.0
    local_prefill_threshold: int = 64
    local_prefill_hit_ratio: float = 0.8
    colocated: bool = False
    weights: C.CostWeights = field(default_factory=C.CostWeights)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"router temperature must be >= 0 (0 = always the cheapest node), "
                             f"got {self.temperature}")
        if self.local_prefill_threshold < 0 or not 0.0 <= self.local_prefill_hit_ratio <= 1.0:
            raise ValueError("local_prefill_threshold must be >= 0 tokens and "
                             "local_prefill_hit_ratio in [0, 1]")


Pick = tuple[WorkerView, float]            # chosen worker and its cost


def _as_dict(matches: Mapping[str, MatchInfo]) -> Mapping[str, MatchInfo]:
    """A plain mapping for a per-worker scan (one lookup, not a walk over ``Matches`` groups per worker)."""
    return matches.as_dict() if isinstance(matches, Matches) else matches


def _getter(matches: Mapping[str, MatchInfo]) -> Callable[[str], MatchInfo | None]:
    """``matches.get`` for a per-worker scan."""
    return _as_dict(matches).get


def with_in_flight(matches: Matches | MutableMapping[str, MatchInfo], in_flight: InFlightMatch) -> None:
    """Extend the in-flight node's indexed match to the blocks sent to it (in place)."""
    m = matches.get(in_flight.worker_id, NO_MATCH)
    extra = in_flight.blocks - m.blocks
    if extra > 0:
        matches[in_flight.worker_id] = MatchInfo(m.device_blocks, m.host_blocks, m.disk_blocks,
                                                 m.in_flight_blocks + extra)


class RoutingPolicy(abc.ABC):
    name: ClassVar[str]

    def __init__(self, config: PolicyConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng

    def route(self, req: RoutingRequest, view: ClusterView, index: PrefixIndex,
              in_flight: InFlightMatch | None = None) -> RoutingDecision:
        """``in_flight``: the prompt's deepest block already sent to a node and
        not yet reported there (inflight.py); counted beyond that node's indexed prefix."""
        if not view.decode:
            raise NoWorkerAvailable(NO_DECODE_WORKER)
        matches = index.match(req.block_hashes)
        if in_flight is not None:
            with_in_flight(matches, in_flight)
        if self.config.colocated:
            d, d_cost = self.pick_colocated(req, view.decode, matches)
            return self._local(req, d, d_cost, matches, len(view.decode))
        d, d_cost = self.pick_decode(req, view.decode, matches)
        d_cached = matches.get(d.worker_id, NO_MATCH).blocks * req.block_size
        local = C.should_prefill_locally(
            req.prompt_tokens - d_cached, req.prompt_tokens, d_cached / req.prompt_tokens,
            self.config.local_prefill_threshold, self.config.local_prefill_hit_ratio)
        if local or not view.prefill:
            return self._local(req, d, d_cost, matches, len(view.decode))
        p, p_cost = self.pick_prefill(req, view.prefill, matches)
        p_match = matches.get(p.worker_id, NO_MATCH)
        return RoutingDecision(
            req.request_id, self.name, DecisionKind.REMOTE_PREFILL, d.worker_id, p.worker_id,
            p_match.blocks * req.block_size, d_cached,
            CostInputs(d.worker_id, matches.get(d.worker_id, NO_MATCH), d.load, d_cost, len(view.decode)),
            CostInputs(p.worker_id, p_match, p.load, p_cost, len(view.prefill)))

    def _local(self, req: RoutingRequest, d: WorkerView, d_cost: float,
               matches: Mapping[str, MatchInfo], n: int) -> RoutingDecision:
        m = matches.get(d.worker_id, NO_MATCH)
        cached = m.blocks * req.block_size
        return RoutingDecision(req.request_id, self.name, DecisionKind.LOCAL_PREFILL, d.worker_id,
                               None, cached, cached, CostInputs(d.worker_id, m, d.load, d_cost, n))

    def sync(self, view: ClusterView) -> None:
        """The router rebuilt its view (liveness changed): policies keeping their own
        order of workers rebuild it here. Default: nothing kept."""

    def update(self, worker: WorkerView, view: ClusterView) -> None:
        """One worker's load changed; ``view`` is the router's new view."""

    @abc.abstractmethod
    def pick_decode(self, req: RoutingRequest, workers: Sequence[WorkerView],
                    matches: Mapping[str, MatchInfo]) -> Pick: ...

    @abc.abstractmethod
    def pick_prefill(self, req: RoutingRequest, workers: Sequence[WorkerView],
                     matches: Mapping[str, MatchInfo]) -> Pick: ...

    @abc.abstractmethod
    def pick_colocated(self, req: RoutingRequest, workers: Sequence[WorkerView],
                       matches: Mapping[str, MatchInfo]) -> Pick: ...

    def _select(self, workers: Sequence[WorkerView], costs: list[float], start: int = 0) -> Pick:
        i = C.select(costs, self.config.temperature, self.rng, start)
        return workers[i], costs[i]


class PrefixAwarePolicy(RoutingPolicy):
    """Cheapest node by cost.py: cached prefix against queue and decode load.

    From ``fast_min_workers`` workers in a pool, each role's load-only cost
    terms are kept in step with the router's view (``RoleCosts``, through
    ``sync`` / ``update``) and a decision adds the match term per group of
    equal matches: Python lists summed at C speed (``map(add, ...)``) up to
    ``LIST_MAX`` workers in the role, numpy arrays above; otherwise, or for a
    view the router did not sync, each worker is costed in Python. All give
    the same choice and cost (a test compares them)."""
    name = "prefix_aware"
    fast_min_workers: ClassVar[int] = 8           # per pool, below it the Python scan is as fast (lists: LIST_MAX)

    def __init__(self, config: PolicyConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self._synced: ClusterView | None = None
        self._roles: dict[str, RoleCosts] = {}
        self._busy_weights = C.busy_weights(config.weights)

    def _decode_base(self, load: WorkerLoad) -> float:
        """A decode node's cost apart from the blocks it must pull (C.decode_node_cost)."""
        w = self.config.weights
        return w.running * load.running + w.kv_usage * load.kv_usage + w.queued_token * load.queued_prefill_tokens

    def _prefill_base(self, load: WorkerLoad) -> float:
        return self.config.weights.queued_token * load.queued_prefill_tokens

    def sync(self, view: ClusterView) -> None:
        if max(len(view.prefill), len(view.decode)) < self.fast_min_workers:
            self._synced, self._roles = None, {}
            return
        self._roles = {"prefill": RoleCosts(view.prefill, self._prefill_base),
                       "decode": RoleCosts(view.decode, self._decode_base)}
        self._synced = view

    def update(self, worker: WorkerView, view: ClusterView) -> None:
        if self._synced is None:
            return
        role = "prefill" if worker.pool == "prefill" else "decode"
        self._roles[role].update(worker, getattr(view, role))
        self._synced = view

    def _vector(self, workers: Sequence[WorkerView], role: str,
                matches: Mapping[str, MatchInfo]) -> RoleCosts | None:
        """The role's RoleCosts when the router synced this very view and the
        matches come grouped from the index; None: cost each worker in Python."""
        synced = self._synced
        if synced is None or not isinstance(matches, Matches):
            return None
        if workers is not (synced.prefill if role == "prefill" else synced.decode):
            return None
        return self._roles[role]

    def _select_array(self, workers: Sequence[WorkerView], costs: np.ndarray, start: int = 0) -> Pick:
        """``_select`` over an array of costs: at temperature 0 the first minimum at
        or after ``start`` (as ``C.select``), else ``C.select`` itself on the same values."""
        if self.config.temperature == 0:
            i = int(np.argmin(costs))
            if start > i and costs[i] == costs[start:].min():
                i = start + int(np.argmin(costs[start:]))
        else:
            i = C.select(costs.tolist(), self.config.temperature, self.rng)
        return workers[i], float(costs[i])

    def _prefill_costs(self, req: RoutingRequest, workers: Sequence[WorkerView],
                       matches: Mapping[str, MatchInfo], w: C.CostWeights) -> list[float]:
        bs, get = req.block_size, _getter(matches)
        total = req.prompt_tokens / bs
        cold, wq = w.uncached_token * total * bs, w.queued_token   # = C.prefill_cost(total, q, bs, w)
        costs = []
        for x in workers:
            m = get(x.worker_id)
            if m is None:
                costs.append(cold + wq * x.load.queued_prefill_tokens)
            else:
                costs.append(self._matched_prefill_cost(req, m, x.load.queued_prefill_tokens, w))
        return costs

    def _matched_prefill_cost(self, req: RoutingRequest, m: MatchInfo, queued: int, w: C.CostWeights) -> float:
        bs = req.block_size
        total = req.prompt_tokens / bs
        if m.host_blocks or m.disk_blocks or m.in_flight_blocks:
            uncached = total - C.effective_cached_blocks(m.device_blocks, m.host_blocks, m.disk_blocks,
                                                         w, m.in_flight_blocks)
        else:
            uncached = total - m.device_blocks
        return C.prefill_cost(uncached, queued, bs, w, m.in_flight_blocks)

    def _prefill_cost_array(self, req: RoutingRequest, rc: RoleCosts, matches: Matches,
                            w: C.CostWeights) -> np.ndarray:
        """``_prefill_costs`` for every member of ``rc``, the same float64 arithmetic:
        ``uncached_token * uncached * block_size + queued_token * queued``; a match
        with off-device or in-flight blocks is costed by ``_matched_prefill_cost``."""
        bs = req.block_size
        total = req.prompt_tokens / bs
        new_work = np.full(len(rc), w.uncached_token * total * bs)
        slow: dict[int, MatchInfo] = {}

        def apply(positions, info: MatchInfo) -> None:
            if info.host_blocks or info.disk_blocks or info.in_flight_blocks:
                slow.update((int(i), info) for i in positions)
                return
            new_work[positions] = w.uncached_token * (total - info.device_blocks) * bs
            if slow:                                  # a later plain match overrides a slow one
                for i in positions:
                    slow.pop(int(i), None)

        for mask, info in matches.groups:
            apply(rc.positions(mask, matches.ids), info)
        for wid, info in matches.extra.items():
            i = rc.position(wid)
            if i is not None:
                apply([i], info)
        costs = new_work + rc.keys
        for i, info in slow.items():
            costs[i] = self._matched_prefill_cost(req, info, rc.views[i].load.queued_prefill_tokens, w)
        return costs

    def _prefill_cost_list(self, req: RoutingRequest, rc: RoleCosts, matches: Matches,
                           w: C.CostWeights) -> list[float]:
        """``_prefill_costs`` for a small role, the same arithmetic: ``new work +
        queued_token * queued``, the new work set per group of equal matches (a
        host / disk match costed once per group); an in-flight match is costed
        by ``_matched_prefill_cost`` for its worker."""
        bs = req.block_size
        total = req.prompt_tokens / bs
        work = [w.uncached_token * total * bs] * len(rc)
        slow: dict[int, MatchInfo] = {}
        for mask, info in matches.groups:
            self._set_work(work, slow, rc.member_positions(mask, matches.ids), info, total, bs, w)
        for wid, info in matches.extra.items():
            i = rc.position(wid)
            if i is not None:
                self._set_work(work, slow, (i,), info, total, bs, w)
        costs = list(map(add, work, rc.key_list))
        for i, info in slow.items():
            costs[i] = self._matched_prefill_cost(req, info, rc.views[i].load.queued_prefill_tokens, w)
        return costs

    def _set_work(self, work: list[float], slow: dict[int, MatchInfo], positions: Sequence[int],
                  info: MatchInfo, total: float, bs: int, w: C.CostWeights) -> None:
        """A group's new prefill work (``_matched_prefill_cost`` less the queue term)."""
        if info.in_flight_blocks:
            slow.update(dict.fromkeys(positions, info))
            return
        if info.host_blocks or info.disk_blocks:
            v = w.uncached_token * (total - C.effective_cached_blocks(
                info.device_blocks, info.host_blocks, info.disk_blocks, w, 0)) * bs
        else:
            v = w.uncached_token * (total - info.device_blocks) * bs
        for i in positions:
            work[i] = v
        if slow:                                      # a later plain match overrides an in-flight one
            for i in positions:
                slow.pop(i, None)

    def pick_prefill(self, req, workers, matches) -> Pick:
        """Ties (equal cost: often an idle pool and a prefix nobody holds) go to the
        tied node with the fewest prompt tokens assigned so far, then the first at or
        after one chosen by the prompt's first block that not every node holds
        (``least_assigned``, ``_tie_start``). Ties to the lowest index piled every new
        conversation onto the first worker; ties by a block hash alone spread them
        only as evenly as a hash does, and conversations' later turns follow them.
        When every node has a queue, a miss weighs ``busy_pool_miss`` x more (cost.py)."""
        rc, start = self._vector(workers, "prefill", matches), _tie_start(req, workers, matches)
        busy = C.busy_pool(x.load.queued_prefill_tokens for x in workers)
        w = self._busy_weights if busy else self.config.weights
        if w.min_hit_share:   # short hits count as none (cost.py; decide.c the same); the per-worker path
            rc, matches = None, _long_hits(req, matches, w)
        if rc is None:
            costs: list[float] | np.ndarray = self._prefill_costs(req, workers, matches, w)
        elif len(rc) <= LIST_MAX:
            costs = self._prefill_cost_list(req, rc, matches, w)
        else:
            costs = self._prefill_cost_array(req, rc, matches, w)
        if self.config.temperature:
            return self._select(workers, costs if isinstance(costs, list) else costs.tolist(), start)
        i = least_assigned(workers, costs, start)
        return workers[i], float(costs[i])

    def pick_decode(self, req, workers, matches) -> Pick:
        wt, n_full = self.config.weights.transfer_block, len(req.block_hashes)
        rc = self._vector(workers, "decode", matches)
        if rc is None:
            get, base = _getter(matches), self._decode_base
            costs = []
            for x in workers:
                m = get(x.worker_id)
                costs.append(base(x.load) + wt * (n_full - m.blocks if m is not None else n_full))
            return self._select(workers, costs)
        if len(rc) > LIST_MAX:
            return self._select_array(workers, rc.keys + wt * (n_full - rc.match_blocks(matches)))
        penalty = [wt * n_full] * len(rc)
        for mask, info in matches.groups:
            p = wt * (n_full - info.blocks)
            for i in rc.member_positions(mask, matches.ids):
                penalty[i] = p
        for wid, info in matches.extra.items():
            at = rc.position(wid)
            if at is not None:
                penalty[at] = wt * (n_full - info.blocks)
        return self._select(workers, list(map(add, rc.key_list, penalty)))

    def pick_colocated(self, req, workers, matches) -> Pick:
        w = self.config.weights
        costs = self._prefill_costs(req, workers, matches, w)
        costs = [c + C.decode_cost(x.load.running, x.load.kv_usage, w) for c, x in zip(costs, workers)]
        return self._select(workers, costs)


def _long_hits(req: RoutingRequest, matches: Mapping[str, MatchInfo], w: C.CostWeights) -> dict[str, MatchInfo]:
    """The matches that cover at least ``min_hit_share`` of the prompt (CostWeights.min_hit_share)."""
    floor = w.min_hit_share * req.prompt_tokens / req.block_size
    return {wid: m for wid, m in _as_dict(matches).items()
            if C.effective_cached_blocks(m.device_blocks, m.host_blocks, m.disk_blocks, w, m.in_flight_blocks) >= floor}


def least_assigned(workers: Sequence[WorkerView], costs: list[float] | np.ndarray, start: int) -> int:
    """The cheapest prefill node; among equally cheap ones, the one this router has sent
    the fewest prompt tokens to compute, then the first at or after ``start``, wrapping
    round. Equal costs are common: every new conversation on an idle pool, or prompts
    that share only a block every node holds. Sending those to the least-assigned node
    spreads the conversations, and the later turns that follow each one home, evenly."""
    if isinstance(costs, np.ndarray):
        tied = np.flatnonzero(costs == costs.min()).tolist()
    else:
        lo = min(costs)
        tied = [i for i, c in enumerate(costs) if c == lo]
    if len(tied) == 1:
        return tied[0]
    n = len(workers)
    return min(tied, key=lambda i: (workers[i].assigned_tokens, (i - start) % n))


def _tie_start(req: RoutingRequest, workers: Sequence[WorkerView], matches: Mapping[str, MatchInfo]) -> int:
    """Where a prefill tie starts looking, modulo the pool size: the hash of the
    prompt's first block that not every worker of the pool holds (its last block
    when they all hold it all; the request id's CRC without blocks). A prefix
    nobody holds keeps one start (its first block), so its requests find one
    home; prompts that share only what the whole pool holds (a system block
    every worker has cached) start from the block where they differ, so new
    conversations spread instead of piling onto one node."""
    n = len(workers)
    if n <= 1:
        return 0
    hashes = req.block_hashes
    if not hashes:
        return zlib.crc32(req.request_id.encode()) % n
    get, shared = _getter(matches), len(hashes) - 1
    for x in workers:
        m = get(x.worker_id)
        if m is None:
            return hashes[0] % n
        shared = min(shared, m.blocks)
    return hashes[shared] % n


class LeastLoadedPolicy(RoutingPolicy):
    """Prefix-blind: the node with the least queued work / decode load."""
    name = "least_loaded"

    def pick_prefill(self, req, workers, matches) -> Pick:
        w, bs = self.config.weights, req.block_size
        return self._select(workers, [C.prefill_cost(0, x.load.queued_prefill_tokens, bs, w) for x in workers])

    def pick_decode(self, req, workers, matches) -> Pick:
        w = self.config.weights
        return self._select(workers, [C.decode_node_cost(x.load.running, x.load.kv_usage, 0,
                                                         x.load.queued_prefill_tokens, w)
                                      for x in workers])

    def pick_colocated(self, req, workers, matches) -> Pick:
        return self.pick_decode(req, workers, matches)


class RoundRobinPolicy(RoutingPolicy):
    """Prefix-blind: each pool in turn (cost reported as 0)."""
    name = "round_robin"

    def __init__(self, config: PolicyConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self._turn = {"prefill": 0, "decode": 0}

    def _next(self, pool: str, workers: Sequence[WorkerView]) -> Pick:
        i = self._turn[pool]
        self._turn[pool] = i + 1
        return workers[i % len(workers)], 0.0

    def pick_prefill(self, req, workers, matches) -> Pick:
        return self._next("prefill", workers)

    def pick_decode(self, req, workers, matches) -> Pick:
        return self._next("decode", workers)

    def pick_colocated(self, req, workers, matches) -> Pick:
        return self._next("decode", workers)


POLICIES: Mapping[str, type[RoutingPolicy]] = MappingProxyType(
    {p.name: p for p in (PrefixAwarePolicy, RoundRobinPolicy, LeastLoadedPolicy)})


def make_policy(name: str, config: PolicyConfig, rng: random.Random) -> RoutingPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown router policy {name!r}: choose one of {', '.join(POLICIES)}") from None
    return cls(config, rng)

"""`ClusterSim`: a pdserve cluster on a virtual clock.

Arrival -> the real `Router` decides (on the KV events and load reports it
has received so far) -> a remote prefill runs on the prefill node (its real
scheduler, ``hold_kv_on_finish``) and produces the first token -> the decode
node reserves blocks with `add_remote_request` (its own prefix cache counts)
and pulls only the missing blocks (transfer time from the cost model,
serialised per decode NIC) -> the prefill node releases its held blocks and
the decode node joins the request with `remote_kv_ready` and decodes to the
trace's output length. A local prefill (conditional disaggregation, or
colocated mode when there are no prefill nodes) runs entirely on the decode
node. Every ``report_interval_s`` each node whose state changed sends its
load and drained KV events, which reach the router ``report_lag_s`` later
(the real backend polls the same two things together).

With ``SimConfig.autoscale`` the pools change size while it runs
(cluster/tools/sim/autoscale.py drives the real controller): `provision` adds a
node that joins the router after a start-up delay; `shrink` cancels starting
nodes, then drains ready ones (the router stops routing to them; they leave
once no live request holds them: a prefill node when its held KV was pulled, a
decode node when its requests finished). Worker-hours count every node from
provisioning (or the start) to leaving (or the end).
"""
from __future__ import annotations

import gc
import json
import random
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from cluster.router import DecisionKind, PolicyConfig, Router, RouterConfig, RoutingRequest, WorkerLoad
from cluster.router.outstanding import OutstandingPrefills
from cluster.router.reserve import reserve_at_routing
from cluster.tools.sim.autoscale import SimAutoscale, SimAutoscaler, worker_hours
from cluster.tools.sim.cost_model import CostModel
from cluster.tools.sim.events import EventLoop
from cluster.tools.sim.insitu import Interference, step_kind
from cluster.tools.sim.metrics import LogHistogram, NodeUsage, RequestRecord, Slo, summarize
from cluster.tools.sim.node import SimNode
from cluster.tools.sim.reservation import RESERVATION_TTL_FACTOR, Reservations
from cluster.tools.sim.split_prefill import SplitPrefill, SplitPrefills
from cluster.tools.sim.workload import Prompt, PromptBuilder, TraceRequest
from engine.block_pool import KVBlock
from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import RemoteAllocation, Scheduler
from engine.step_trace import StepShape


@dataclass(frozen=True)
class SimConfig:
    prefill_nodes: int
    decode_nodes: int
    policy: str = "prefix_aware"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    block_size: int = 512
    num_blocks: int | None = None             # per node; None: the profile's KV capacity
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 1 << 18
    report_interval_s: float = 0.1
    report_lag_s: float = 0.002
    transfer_timeout_s: float = 10.0          # decode node without room: recompute locally after this
    collapse: bool = True
    seed: int = 0
    slo: Slo = field(default_factory=Slo)
    # every node on one shared host whose contention slows steps (measured in situ:
    # cluster/tools/sim/insitu.py); None: each node has its hardware to itself
    interference: Interference | None = None
    # every this many simulated seconds, one progress line to stderr (0: none); changes no result
    progress_s: float = 0.0
    # pools sized by the autoscaling controller while it runs (prefill_nodes / decode_nodes: the
    # starting sizes); None: fixed pools
    autoscale: SimAutoscale | None = None
    # as ServeConfig.reserve_decode_blocks (on in the live cluster by default): a hand-off's decode
    # blocks are reserved when it is routed, while its prompt is prefilled (cluster/tools/sim/reservation.py);
    # False: allocated only when the prefill ends
    reserve_decode_blocks: bool = True
    # every node's SchedulerConfig.queue_order and queue_max_pass_s (engine/queue_order.py)
    queue_order: str = "fcfs"
    queue_max_pass_s: float = 20.0
    # every node's SchedulerConfig.final_chunk_unpadded
    final_chunk_unpadded: bool = False
    # a long cold prefill spread over idle prefill nodes (a what-if of Mooncake's chunked pipeline
    # parallelism: cluster/tools/sim/split_prefill.py); None: off
    split_prefill: SplitPrefill | None = None
    # as ServeConfig.prefill_queue_limit: >= 0 holds an arriving request in one FIFO at the router
    # while every prefill node has more prompt tokens than this outstanding (routed there, prefill
    # not ended: cluster/router/outstanding.py), routing it when a prefill ends and leaves room
    # (cluster/orchestration/prefill_gate.py); -1: off
    prefill_queue_limit: int = -1
    # > 0: the prefill nodes share this many cores, node i pinned to core i % prefill_cores (as
    # benchmarks/routing.py pins its prefill workers), and a prefill node's step runs at 1 / k of its
    # isolated speed while k of its core's nodes are mid-step (processor sharing); decode nodes keep
    # their own hardware. 0: every node has its own
    prefill_cores: int = 0

    def __post_init__(self) -> None:
        if self.decode_nodes < 1 or self.prefill_nodes < 0:
            raise ValueError("give at least one decode node (--decode-nodes >= 1) and --prefill-nodes >= 0 "
                             "(0 = colocated: every node prefills and decodes)")
        if self.report_interval_s <= 0 or self.report_lag_s < 0:
            raise ValueError("report_interval_s must be > 0 and report_lag_s >= 0 seconds")
        if self.autoscale is not None and self.prefill_nodes < 1:
            raise ValueError("--autoscale sizes a prefill and a decode pool: give --prefill-nodes >= 1 "
                             "(autoscaling colocated nodes is not supported)")
        if self.progress_s < 0:
            raise ValueError(f"progress_s must be >= 0 simulated seconds (0 = no progress lines), "
                             f"got {self.progress_s}")
        if self.prefill_cores < 0:
            raise ValueError(f"prefill_cores must be >= 0 (0 = every node on its own hardware), got {self.prefill_cores}")
        if self.prefill_cores and (self.interference is not None or self.autoscale is not None
                                   or self.split_prefill is not None):
            raise ValueError("prefill_cores models a fixed prefill pool pinned to shared cores: leave interference, "
                             "autoscale and split_prefill None with it")
        if self.split_prefill is not None:
            if self.prefill_nodes < self.split_prefill.nodes:
                raise ValueError(f"split_prefill spreads a prefill over {self.split_prefill.nodes} prefill "
                                 f"nodes: give --prefill-nodes >= {self.split_prefill.nodes}, got "
                                 f"{self.prefill_nodes}")
            if self.autoscale is not None or self.interference is not None:
                raise ValueError("split_prefill is modelled on fixed pools of nodes with their own hardware: "
                                 "leave autoscale and interference None with it")


class _Live:
    __slots__ = ("rec", "trace", "tokens", "hashes", "packed", "blocks", "deadline", "no_room", "joining",
                 "reservation", "reserving", "expiring")

    def __init__(self, rec: RequestRecord, trace: TraceRequest, prompt: Prompt) -> None:
        self.rec, self.trace = rec, trace
        self.tokens, self.hashes, self.packed, self.blocks = prompt
        self.deadline = 0.0
        self.no_room: tuple | None = None     # room() when the last join failed
        self.joining = False                  # its hand-off waits to join the decode node
        self.reservation: RemoteAllocation | None = None     # decode blocks reserved while it prefills
        self.reserving = False                # the reserve call waits on the decode node
        self.expiring = False                 # its reservation expired; the abort waits on the decode node

    @property
    def request_id(self) -> str:
        return self.rec.request_id


def _nothing(node: SimNode) -> None:
    pass


def room(scheduler: Scheduler, request: Request) -> tuple[int, int, int, int, int]:
    """What decides whether `add_remote_request` finds room for ``request``
    (KVCacheManager.allocate_slots): free blocks, sequence slots in use, and the
    request's own prefix hits on the node: how many, how many on a lower tier
    (each needs a free block to page in) and how many sit in the free queue
    (taking them leaves fewer free). A join that failed fails again while this
    is unchanged, so retrying it is skipped. The node's cached-block count is
    not enough: a request's hits can change (another request's KV lands with
    the same prefix, a held hit is released) while the counts come back equal."""
    kv = scheduler.kv
    hits = kv.get_computed_blocks(request, max_tokens=request.num_prompt_tokens).blocks
    device = [b for b in hits if isinstance(b, KVBlock)]
    return (kv.num_free_blocks, scheduler.num_running + scheduler.num_remote, len(hits),
            len(hits) - len(device), sum(1 for b in device if b.ref_cnt == 0))


def descriptor_runs(src: list[int], dst: list[int]) -> int:
    """Descriptors of a block-major pull: one per run consecutive on both sides."""
    runs = 0
    for i in range(len(dst)):
        if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs += 1
    return runs


class ClusterSim:
    def __init__(self, config: SimConfig, cost: CostModel, workload: list[TraceRequest],
                 builder: PromptBuilder) -> None:
        if builder.block_size != config.block_size:
            raise ValueError(f"the prompt builder's block size {builder.block_size} must equal the "
                             f"simulated nodes' {config.block_size}")
        self.config, self.cost, self.builder = config, cost, builder
        self.workload = sorted(workload, key=lambda r: r.arrival_s)
        self.loop = EventLoop()
        self._rng = np.random.default_rng(config.seed)      # step jitter of the shared-host model
        colocated = config.prefill_nodes == 0
        pc = config.policy_config
        if colocated and not pc.colocated:
            pc = PolicyConfig(pc.temperature, pc.local_prefill_threshold, pc.local_prefill_hit_ratio, True,
                              pc.weights)
        self.router = Router(RouterConfig(config.policy, pc), rng=random.Random(config.seed),
                             clock=self.loop.clock)
        self.split = (SplitPrefills(config.split_prefill, cost, config.max_num_batched_tokens, self)
                      if config.split_prefill is not None else None)
        nb = config.num_blocks or cost.kv_capacity_tokens // config.block_size
        self.num_blocks = nb
        self.start_s = self.workload[0].arrival_s if self.workload else 0.0
        self._init_pools(config, colocated)
        self.autoscaler = SimAutoscaler(self, config.autoscale) if config.autoscale is not None else None
        self._frontend_until = 0.0       # the frontend's FIFO work ends (with interference.frontend)
        self._frontend_gen = 0
        self.records: list[RequestRecord] = []
        self.live: dict[str, _Live] = {}
        self.itl = LogHistogram()
        self._next = 0
        self.wall_s = 0.0
        self.fallbacks = 0
        self.reservations = Reservations(self.loop, RESERVATION_TTL_FACTOR * config.transfer_timeout_s,
                                         lambda live: self._request(live, live.tokens, live.trace.output_length))
        self.held: deque[tuple[TraceRequest, float]] = deque()   # arrivals the prefill gate holds, oldest first
        self.gate_held = 0                     # arrivals the prefill gate has held, in all
        self.outstanding = OutstandingPrefills()   # the gate's count of prefill tokens sent, not ended

    # ---- pool membership (fixed, or changed by the autoscaler) ----------------
    def _init_pools(self, config: SimConfig, colocated: bool) -> None:
        self.nodes: dict[str, SimNode] = {}
        self._core: dict[str, int] = {}               # prefill_cores: prefill node id -> its core
        self.nic_free: dict[str, float] = {}
        # pool membership over time: node id -> [role, joined, left]; live requests holding each node
        self.spans: dict[str, list] = {}
        self.refs: dict[str, int] = {}
        self.starting: dict[str, dict[str, int]] = {"prefill": {}, "decode": {}}   # role -> id -> generation
        # under the autoscaler's fleet cap (the GPUs the fleet owns) a new node waits, unpaid, for a
        # GPU that a draining or cancelled node gives back, as a pending Ray actor does: id -> (role,
        # generation, start-up seconds), oldest first
        self.gpu_cap = config.autoscale.config.max_total_workers if config.autoscale is not None else None
        self.pending: dict[str, tuple[str, int, float]] = {}
        self.draining: set[str] = set()
        self.drained_at: dict[str, float] = {}        # node id -> when the router stopped routing to it
        self.retired: list[SimNode] = []
        self._ids = {"prefill": 0, "decode": 0, "colocated": 0}
        self._start_gen = 0
        roles = ["prefill"] * config.prefill_nodes + ["colocated" if colocated else "decode"] * config.decode_nodes
        for role in roles:
            self._add_node(role, self._new_id(role), self.start_s)

    def _new_id(self, role: str) -> str:
        i = self._ids[role]
        self._ids[role] += 1
        return f"{'p' if role == 'prefill' else 'd'}{i:04d}"

    def _add_node(self, role: str, nid: str, joined: float) -> SimNode:
        c = self.config
        sched = Scheduler(SchedulerConfig(c.max_num_batched_tokens, c.max_num_seqs, queue_order=c.queue_order,
                                          queue_max_pass_s=c.queue_max_pass_s,
                                          final_chunk_unpadded=c.final_chunk_unpadded),
                          CacheConfig(block_size=c.block_size, num_blocks=self.num_blocks), self.num_blocks,
                          c.max_model_len, clock=self.loop.clock)
        shared = c.interference is not None
        pinned = bool(c.prefill_cores) and role == "prefill"
        if pinned:
            self._core[nid] = len(self._core) % c.prefill_cores
        node = self.nodes[nid] = SimNode(nid, role, sched, self.cost, self.loop, self, collapse=c.collapse,
                                         slowdown=self._slowdown if shared else self._core_share if pinned else None,
                                         on_busy_change=self._host_changed if shared or pinned else None,
                                         jitter=self._jitter if shared and c.interference.jitter else None,
                                         step_cost=self.split.step_seconds if self.split is not None else None)
        self.nic_free[nid] = 0.0
        self.refs[nid] = 0
        self.spans.setdefault(nid, [role, joined, None])
        self.router.add_worker(nid, role)
        return node

    def ready_nodes(self, role: str) -> list[SimNode]:
        """Nodes of ``role`` taking requests (not starting, not draining)."""
        return [n for nid, n in self.nodes.items() if n.role == role and nid not in self.draining]

    def starting_count(self, role: str) -> int:
        """Nodes of ``role`` decided but not ready: starting, or waiting for a GPU under the cap."""
        return len(self.starting[role]) + sum(1 for r, _, _ in self.pending.values() if r == role)

    def gpus_held(self) -> int:
        """Nodes holding a GPU: ready, draining and starting (not those waiting for one)."""
        return len(self.nodes) + sum(len(s) for s in self.starting.values())

    def draining_count(self, role: str) -> int:
        """Nodes of ``role`` out of the router, still finishing what they hold (still paid for)."""
        return sum(1 for nid in self.draining if self.nodes[nid].role == role)

    def has_work(self) -> bool:
        return bool(self.live) or bool(self.held) or self._next < len(self.workload)

    def provision(self, role: str, startup_s: float) -> str:
        """A new node of ``role``: paid for from now, taking requests ``startup_s`` later; under the
        fleet cap with every GPU held (a drained node not gone yet), from when one is given back."""
        nid = self._new_id(role)
        self._start_gen += 1
        if self.gpu_cap is not None and self.gpus_held() >= self.gpu_cap:
            self.pending[nid] = (role, self._start_gen, startup_s)
        else:
            self._boot(role, nid, self._start_gen, startup_s)
        return nid

    def _boot(self, role: str, nid: str, gen: int, startup_s: float) -> None:
        self.starting[role][nid] = gen
        self.spans[nid] = [role, self.loop.now, None]
        self.loop.after(startup_s, self._ready, role, nid, gen)

    def _gpu_freed(self) -> None:
        """A GPU was given back: the oldest nodes waiting for one start booting."""
        while self.pending and self.gpus_held() < self.gpu_cap:
            nid = next(iter(self.pending))
            role, gen, startup_s = self.pending.pop(nid)
            self._boot(role, nid, gen, startup_s)

    def _ready(self, role: str, nid: str, gen: int) -> None:
        if self.starting[role].get(nid) != gen:
            return                                    # cancelled while starting
        del self.starting[role][nid]
        self._add_node(role, nid, self.spans[nid][1])

    def shrink(self, role: str, count: int) -> None:
        """Take ``count`` nodes out of ``role``'s pool: those waiting for a GPU first, then
        starting ones (both newest first), then drain the ready nodes holding the fewest live
        requests."""
        for nid in [n for n, (r, _, _) in self.pending.items() if r == role][::-1][:count]:
            del self.pending[nid]
            count -= 1
        starting = self.starting[role]
        for nid in sorted(starting, key=starting.get, reverse=True)[:count]:
            del starting[nid]
            self.spans[nid][2] = self.loop.now
            count -= 1
        if self.pending:
            self._gpu_freed()
        ready = sorted(self.ready_nodes(role), key=lambda n: (self.refs[n.node_id], n.node_id))
        if count >= len(ready):
            raise ValueError(f"cannot drain {count} of {len(ready)} ready {role} nodes: a pool keeps at least one")
        for node in ready[:count]:
            self.draining.add(node.node_id)
            self.drained_at[node.node_id] = self.loop.now
            self.router.on_worker_dead(node.node_id)
            self._maybe_leave(node.node_id)

    def _hold(self, nid: str) -> None:
        self.refs[nid] += 1

    def _unhold(self, nid: str) -> None:
        self.refs[nid] -= 1
        self._maybe_leave(nid)

    def _maybe_leave(self, nid: str) -> None:
        if self.refs[nid] or nid not in self.draining:
            return
        self.draining.discard(nid)
        self.spans[nid][2] = self.loop.now
        self.retired.append(self.nodes.pop(nid))
        if self.pending:
            self._gpu_freed()

    def worker_hours(self, end: float) -> dict:
        return worker_hours([(r, a, end if b is None else b) for r, a, b in self.spans.values()],
                            self.start_s, end)

    def _frontend_work(self, t: float, arrivals: int, tokens: int) -> None:
        fe = self.config.interference.frontend if self.config.interference is not None else None
        if fe is None:
            return
        was_busy = self._frontend_until > self.loop.now
        self._frontend_until = max(t, self._frontend_until) + arrivals * fe.arrival_s + tokens * fe.token_s
        self._frontend_gen += 1
        self.loop.at(self._frontend_until, self._frontend_idle, self._frontend_gen)
        if not was_busy and self._frontend_until > self.loop.now:
            self._host_changed(None)

    def _frontend_idle(self, gen: int) -> None:
        if gen == self._frontend_gen:
            self._host_changed(None)

    def _host_changed(self, changed: SimNode | None) -> None:
        """A party on the shared host started or stopped being busy: every other
        step in flight goes on at its new speed."""
        for node in self.nodes.values():
            if node is not changed and node.busy:
                node.retime()

    def _jitter(self, node: SimNode, sched) -> float:
        return self.config.interference.jitter_at(node.role, step_kind(StepShape.of(sched)), self._rng.random())

    def _core_share(self, node: SimNode, sched) -> float:
        """prefill_cores: the step runs at 1 / k of its speed, k = its core's nodes mid-step (itself too)."""
        core = self._core[node.node_id]
        return float(1 + sum(self.nodes[nid].busy for nid, c in self._core.items()
                             if c == core and nid != node.node_id))

    def _slowdown(self, node: SimNode, sched) -> float:
        busy = sum(n.busy for n in self.nodes.values()) - node.busy + (self._frontend_until > self.loop.now)
        return self.config.interference.factor(node.role, step_kind(StepShape.of(sched)), busy)

    # ---- driving -------------------------------------------------------------
    def run(self) -> dict:
        t0 = time.perf_counter()
        if self.workload:
            self.loop.at(self.workload[0].arrival_s, self._arrive)
            self.loop.at(self.workload[0].arrival_s, self._tick)
            if self.config.progress_s:
                self.loop.at(self.workload[0].arrival_s + self.config.progress_s, self._progress, t0)
            if self.autoscaler is not None:
                self.autoscaler.start(self.workload[0].arrival_s)
        # The nodes' block pools are millions of long-lived objects, and every live
        # prompt a list of thousands of ints: frozen, and with rarer young collections,
        # the cyclic collector stops re-scanning them (~15% of a loaded 1000-node run's
        # time before). Restored after, so everything can be freed.
        thresholds = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(max(thresholds[0], 100_000), max(thresholds[1], 50), max(thresholds[2], 100))
        try:
            self.loop.run()
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()
        self.wall_s = time.perf_counter() - t0
        return self.summary()

    def _progress(self, t0: float) -> None:
        wall = time.perf_counter() - t0
        sim = self.loop.now - self.workload[0].arrival_s
        done = len(self.records) - len(self.live)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20     # KiB on Linux
        print(json.dumps({"progress": {"sim_s": round(sim, 1), "wall_s": round(wall, 1),
                                       "sim_s_per_wall_s": round(sim / wall, 3) if wall else None,
                                       "arrived": len(self.records), "finished": done, "live": len(self.live),
                                       "of": len(self.workload), "peak_rss_gb": round(rss, 2)}}),
              file=sys.stderr, flush=True)
        if self.live or self.held or self._next < len(self.workload):
            self.loop.after(self.config.progress_s, self._progress, t0)

    def summary(self) -> dict:
        start = self.workload[0].arrival_s if self.workload else 0.0
        end = max((r.finish_s for r in self.records if r.finish_s is not None), default=start)
        every = list(self.nodes.values()) + self.retired
        nodes = [NodeUsage(n.node_id, n.role, n.busy_s, n.steps, n.scheduler.kv.prefix_cache_stats.queried_tokens,
                           n.scheduler.kv.prefix_cache_stats.hit_tokens) for n in every]
        c = self.config
        extra = {"config": {"prefill_nodes": c.prefill_nodes, "decode_nodes": c.decode_nodes, "policy": c.policy,
                            "block_size": c.block_size, "num_blocks_per_node": self.num_blocks,
                            "cost_model": getattr(self.cost, "name", type(self.cost).__name__),
                            "local_prefill_threshold": c.policy_config.local_prefill_threshold,
                            "report_interval_s": c.report_interval_s, "report_lag_s": c.report_lag_s},
                 "fleet": {"worker_hours": self.worker_hours(end)},
                 "sim": {"events": self.loop.events_run, "node_runs": sum(n.events for n in every),
                         "engine_steps": sum(n.steps for n in every), "wall_s": self.wall_s,
                         "sim_s_per_wall_s": (end - start) / self.wall_s if self.wall_s else None,
                         "local_recompute_fallbacks": self.fallbacks, "prefill_gate_held": self.gate_held,
                         "decode_reservations": dict(self.reservations.counts)}}
        if self.autoscaler is not None:
            extra["autoscale"] = self.autoscaler.summary()
        if self.split is not None:
            extra["split_prefill"] = self.split.summary()
        return summarize(self.records, self.itl, nodes, end - start, c.slo, extra)

    def _arrive(self) -> None:
        tr = self.workload[self._next]
        self._next += 1
        if self._next < len(self.workload):
            self.loop.at(max(self.workload[self._next].arrival_s, self.loop.now), self._arrive)
        self._frontend_work(self.loop.now, 1, 0)
        # as the live gate: a prompt short enough for the decode node to prefill is never held
        if (self._gated() and tr.input_length > self.config.policy_config.local_prefill_threshold
                and (self.held or not self._prefill_room())):
            self.held.append((tr, self.loop.now))
            self.gate_held += 1
            return
        self._route(tr, self.loop.now)

    def _gated(self) -> bool:
        return self.config.prefill_queue_limit >= 0 and bool(self.ready_nodes("prefill"))

    def _prefill_room(self) -> bool:
        return self.outstanding.room([n.node_id for n in self.ready_nodes("prefill")],
                                     self.config.prefill_queue_limit)

    def _release_held(self) -> None:
        """The prefill gate: route held arrivals, oldest first, while a prefill node has room."""
        while self.held and (not self._gated() or self._prefill_room()):
            self._route(*self.held.popleft())

    def _route(self, tr: TraceRequest, arrived: float) -> None:
        prompt = self.builder.prompt(tr)
        tokens, rid = prompt.tokens, tr.request_id
        d = self.router.route(RoutingRequest(rid, len(tokens), tuple(prompt.hashes), self.config.block_size))
        rec = RequestRecord(rid, arrived, len(tokens), tr.output_length, d.kind.value,
                            d.prefill_worker_id or d.decode_worker_id, d.decode_worker_id)
        if self.config.prefill_queue_limit >= 0 and d.kind is DecisionKind.REMOTE_PREFILL:
            self.outstanding.sent(rid, d.prefill_worker_id, len(tokens) - d.prefill_cached_tokens)
        self.records.append(rec)
        live = self.live[rid] = _Live(rec, tr, prompt)
        self._hold(d.decode_worker_id)
        if d.kind is DecisionKind.REMOTE_PREFILL:
            self._hold(d.prefill_worker_id)
            if self.autoscaler is not None:
                self.autoscaler.on_routed(self.loop.now, len(tokens) - d.prefill_cached_tokens)
            req = self._request(live, tokens, 1, hold=True)
            self.nodes[d.prefill_worker_id].post(lambda n: n.scheduler.add_request(req))
            # as handoff.py: reserved at routing when the prefill starts within a step (cluster/router/reserve.py)
            if self.config.reserve_decode_blocks and reserve_at_routing(d, self.config.max_num_batched_tokens):
                self.reservations.start(self.nodes[d.decode_worker_id], live)
        else:
            req = self._request(live, tokens, tr.output_length)
            self.nodes[d.decode_worker_id].post(lambda n: n.scheduler.add_request(req))

    def _request(self, live: _Live, tokens: list[int], max_tokens: int, hold: bool = False) -> Request:
        n_hash = len(tokens) // self.config.block_size
        return Request(live.rec.request_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       cache_salt=live.trace.salt, arrival_time=live.rec.arrival_s,
                       block_hashes=live.hashes[:n_hash], hold_kv_on_finish=hold,
                       prompt_packed=live.packed if tokens is live.tokens else None,
                       prompt_blocks=live.blocks if tokens is live.tokens else None)

    # ---- node callbacks ------------------------------------------------------
    def on_tokens(self, node: SimNode, requests: list[Request], ends: np.ndarray) -> None:
        first, last, k = float(ends[0]), float(ends[-1]), len(ends)
        self._frontend_work(last, 0, len(requests) * k)
        live, first_gaps = self.live, []
        for r in requests:
            rec = live[r.request_id].rec
            if rec.first_token_s is None:
                rec.first_token_s = first
                rec.cached_tokens = r.num_cached_tokens or 0
                self.router.on_prefill_end(r.request_id)     # as handoff.py: its in-flight record ends
                if self.outstanding.ended(r.request_id) and self.held:
                    self._release_held()                     # as the prefill gate: room on its node
                if self.split is not None:
                    self.split.prefill_ended(r.request_id)
                if self.autoscaler is not None:
                    self.autoscaler.on_first_token(rec)
            else:
                first_gaps.append(first - rec.last_token_s)
            rec.tokens_out += k
            rec.last_token_s = last
        if first_gaps:
            self.itl.add(np.asarray(first_gaps))
        if k > 1:
            self.itl.add(np.diff(ends), weight=len(requests))

    def on_finished(self, node: SimNode, request: Request, t: float) -> None:
        live = self.live[request.request_id]
        if not request.hold_kv_on_finish:
            self._done(live, t, request)
            return
        if live.trace.output_length <= 1:            # the first token ended it: nobody reads the KV
            node.scheduler.release_held(request.request_id)
            self.reservations.free(self.nodes[live.rec.decode_node], live)
            self._unhold(node.node_id)
            self._done(live, t, request)
            return
        live.deadline, live.joining = t + self.config.transfer_timeout_s, True
        decode = self.nodes[live.rec.decode_node]
        # reserving blocks changes no running sequence: it need not end the decode node's run
        decode.post_retry(lambda dn: self._join(dn, node, live), keeps_batch=True)
        # a join waiting for room fails until something on the node is freed (a run boundary),
        # or until its deadline: wake the node then, so it ends the run in flight and falls back
        self.loop.at(live.deadline, self._wake_at_deadline, decode, live)

    def _wake_at_deadline(self, decode: SimNode, live: _Live) -> None:
        if live.joining:
            decode.post(_nothing, retry=True)

    def _done(self, live: _Live, t: float, request: Request) -> None:
        live.rec.finish_s = t
        live.rec.preempted += request.num_preemptions
        del self.live[live.rec.request_id]
        if self.autoscaler is not None:
            self.autoscaler.on_done(live.rec)
        self._unhold(live.rec.decode_node)

    # ---- prefill -> decode hand-off -----------------------------------------
    def _join(self, dn: SimNode, pn: SimNode, live: _Live) -> bool:
        """The hand-off joins ``dn`` (False: it waits for room there; run again)."""
        if self.reservations.expiring(live):   # as DecodeWorker: wait for the expiry to finish
            return False
        alloc = self.reservations.claim(dn, live)
        if alloc is None:
            alloc = self._allocate(dn, pn, live)
            if alloc is None:
                return not live.joining
        self._joined(dn, live)
        self._pull(dn, pn, live, alloc)
        return True

    def _allocate(self, dn: SimNode, pn: SimNode, live: _Live) -> RemoteAllocation | None:
        """The join without a reservation: allocate now. None: no room, and it waits for
        room until its deadline (still joining) or then recomputes on ``dn`` (joined)."""
        rid, now = live.rec.request_id, self.loop.now
        request = self._request(live, live.tokens, live.trace.output_length)
        if now < live.deadline and live.no_room is not None and live.no_room == room(dn.scheduler, request):
            return None
        alloc = dn.scheduler.add_remote_request(request)
        if alloc is not None or now < live.deadline:
            if alloc is None:
                if live.no_room is None:              # as DecodeWorker: now it waits for room here
                    dn.joining += 1                   # (joins run inside post / _end: dn is dirty)
                live.no_room = room(dn.scheduler, request)
            return alloc
        self._joined(dn, live)
        self.fallbacks += 1                           # as DecodeWorker: recompute here, keep the first token
        pn.post(lambda n: n.scheduler.release_held(rid))
        self._unhold(pn.node_id)
        tokens = live.tokens + [dn.output_token]
        dn.scheduler.add_request(self._request(live, tokens, max(1, live.trace.output_length - 1)))
        return None

    def _pull(self, dn: SimNode, pn: SimNode, live: _Live, alloc: RemoteAllocation) -> None:
        """Read the blocks ``dn`` lacks from ``pn`` (serialised on ``dn``'s NIC); decode on when they land."""
        rid, rec, now = live.rec.request_id, live.rec, self.loop.now
        held = pn.scheduler.kv.get_block_ids(rid)
        src, dst = held[alloc.num_cached_blocks:len(alloc.block_ids)], list(alloc.blocks_to_pull)
        nbytes = len(dst) * self.config.block_size * self.cost.kv_bytes_per_token
        rec.decode_cached_tokens = alloc.num_cached_tokens
        rec.transferred_blocks, rec.transferred_bytes = len(dst), nbytes
        rec.descriptors = descriptor_runs(src, dst)
        start = max(now, self.nic_free[dn.node_id])
        done = start + self.cost.transfer_seconds(rec.descriptors, nbytes)
        self.nic_free[dn.node_id] = done
        self.loop.at(done, self._landed, dn, pn, rid)

    @staticmethod
    def _joined(dn: SimNode, live: _Live) -> None:
        live.joining = False
        if live.no_room is not None:                  # it had waited for room
            dn.joining -= 1

    def _landed(self, dn: SimNode, pn: SimNode, rid: str) -> None:
        pn.post(lambda n: n.scheduler.release_held(rid))
        self._unhold(pn.node_id)
        dn.post(lambda n: n.scheduler.remote_kv_ready(rid, n.output_token))

    # ---- load reports and KV events -----------------------------------------
    def _tick(self) -> None:
        batch = []
        for nid, node in self.nodes.items():
            if not node.dirty:
                continue
            node.dirty = False
            s = node.scheduler
            if nid in self.draining:                  # out of the router: it reports nothing more
                s.kv.drain_events()
                continue
            # as DecodeWorker.report: hand-offs waiting for KV room are waiting requests
            queued = s.num_waiting_tokens + (self.split.queued_tokens(nid) if self.split is not None else 0)
            load = WorkerLoad(queued, s.num_running, s.num_waiting + node.joining, s.kv_usage)
            batch.append((nid, load, s.kv.drain_events()))
        if batch:
            self.loop.after(self.config.report_lag_s, self._deliver, batch)
        if self.live or self.held or self._next < len(self.workload):
            self.loop.after(self.config.report_interval_s, self._tick)

    def _deliver(self, batch: list) -> None:
        for nid, load, events in batch:
            if nid not in self.nodes or nid in self.draining:
                continue                              # drained after this report was sent
            if events and self.router.on_events(nid, events).needs_resync:
                self.router.on_snapshot(nid, self.nodes[nid].scheduler.kv.snapshot())
            self.router.update_load(nid, load)

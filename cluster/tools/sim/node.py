"""`SimNode`: one simulated worker. It holds pdserve's real `Scheduler` (and
so the real `KVCacheManager`, block pool and prefix cache) with a null model
executor: the scheduler forms each batch, the cost model says how long the
step takes, and the node feeds `update_from_output` a fixed output token for
every sampled sequence (output lengths come from the trace).

Like the real engine loop, calls from outside (add a request, KV landed,
release held blocks) run between steps: while a step is in flight they wait
in an inbox. A run of pure-decode steps in which nothing can change (no
waiting request, nothing in the inbox, nobody reaches its length, and no
sequence fills a KV block before the run's last step) is one event: the node
plans ``k`` steps at once, and an outside call arriving mid-run cuts the run
at the end of the step in flight. Applying the run repeats
`update_from_output`'s bookkeeping ``k - 1`` times in bulk (advance, append,
cache) through the same `KVCacheManager` calls. Since blocks are allocated
and cached only at run boundaries, the load reports and KV events the router
gets are the ones step-by-step simulation gives; a call that only reserves
blocks (``keeps_batch``, a hand-off) runs at the end of the step in flight
without cutting the run.
"""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from cluster.tools.sim.cost_model import CostModel
from cluster.tools.sim.events import EventLoop
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput

Action = Callable[["SimNode"], None]
Retry = Callable[["SimNode"], bool]
Slowdown = Callable[["SimNode", SchedulerOutput], float]
BusyChange = Callable[["SimNode"], None]
StepCost = Callable[["SimNode", SchedulerOutput, float], float]


class NodeListener(Protocol):
    def on_tokens(self, node: "SimNode", requests: list[Request], ends: np.ndarray) -> None:
        """Each request got one token at each time in ``ends``."""

    def on_finished(self, node: "SimNode", request: Request, t: float) -> None: ...


class _Run:
    __slots__ = ("sched", "ends", "start")

    def __init__(self, sched: SchedulerOutput, ends: np.ndarray, start: float) -> None:
        self.sched, self.ends, self.start = sched, ends, start


class _SameToken:
    """`update_from_output`'s ``sampled`` for a node that samples one fixed token
    for every sequence (a dict of one list per sequence, built per step, cost more)."""
    __slots__ = ("tokens",)

    def __init__(self, token: int) -> None:
        self.tokens = [token]

    def get(self, request_id: str, default=None) -> list[int]:
        return self.tokens


class SimNode:
    def __init__(self, node_id: str, role: str, scheduler: Scheduler, cost: CostModel, loop: EventLoop,
                 listener: NodeListener, *, collapse: bool = True, max_run_steps: int = 4096,
                 output_token: int = 1, slowdown: Slowdown | None = None,
                 on_busy_change: BusyChange | None = None, jitter: Slowdown | None = None,
                 step_cost: StepCost | None = None) -> None:
        if max_run_steps < 1:
            raise ValueError(f"max_run_steps must be >= 1, got {max_run_steps}")
        self.node_id, self.role = node_id, role
        self.scheduler, self.cost, self.loop, self.listener = scheduler, cost, loop, listener
        self.collapse, self.max_run_steps, self.output_token = collapse, max_run_steps, output_token
        self._sampled = _SameToken(output_token)
        # a shared host (cluster/tools/sim/insitu.py): a step progresses at 1 / slowdown(node, step) of
        # its isolated speed, re-evaluated (`retime`) whenever another party on the host starts or
        # stops being busy; steps are then never collapsed into runs
        self.slowdown, self.on_busy_change = slowdown, on_busy_change
        self.jitter = jitter        # with slowdown: each step's isolated cost x jitter(node, step), drawn once
        # a single step's cost as the cost model gives it -> what it costs (split prefills: split_prefill.py)
        self.step_cost = step_cost
        self.lent = False           # lent to another node's split prefill: it takes no step
        self._left = self._since = self._factor = 0.0      # isolated seconds left, as of, at factor
        self._was_busy = False
        if slowdown is not None:
            self.collapse = False
        self.inbox: list[Action] = []
        self.retries: list[Retry] = []
        self._run: _Run | None = None
        self._gen = 0
        self._start_pending = False
        self.busy_s = 0.0
        self.steps = 0
        self.events = 0
        self.deferred = 0           # keeps_batch actions run inside a decode run without cutting it
        self.dirty = True           # state changed since the last load report
        self.joining = 0            # decode role: hand-offs waiting here for KV room (reported as waiting)

    # ---- calls from outside --------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._run is not None

    def post(self, action: Action, *, keeps_batch: bool = False, retry: bool = False) -> None:
        """Run ``action(node)`` between steps (now, if the node is idle).

        ``retry``: then run the pending retries, as a run boundary does (the action
        frees blocks outside a run, or a retry's deadline passed): an idle node has
        no run boundary to run them at.

        ``keeps_batch``: the action adds nothing to the running batch or the
        waiting queue and reads nothing of the running sequences but the KV
        manager and their count (a hand-off reserving blocks). Inside a decode
        run it then runs at the end of the step in flight without ending the
        run: no sequence of a run fills or needs a block before the run's last
        step, so the KV manager there is as step-by-step simulation has it, and
        taking free blocks cannot starve the run. If the action did queue a
        request after all, the run is cut there."""
        self.dirty = True
        if self._run is not None:
            if not (keeps_batch and self._defer(action)):
                self.inbox.append(action)
                self._cut_run()
            return
        action(self)
        if retry and self.retries:
            self.retries = [r for r in self.retries if not r(self)]
        self._kick()

    def _defer(self, action: Action) -> bool:
        run = self._run
        if self.inbox:
            return False
        j = self._in_flight(run)
        if j + 1 >= len(run.ends):
            return False
        self.deferred += 1
        self.loop.at(float(run.ends[j]), self._run_deferred, action, run, j)
        return True

    def _run_deferred(self, action: Action, run: "_Run", j: int) -> None:
        assert self._run is run, f"{self.node_id}: a deferred action outlived its run"
        action(self)
        if self.scheduler.num_waiting:
            self._end_after(run, j)

    def post_retry(self, retry: Retry, *, keeps_batch: bool = False) -> None:
        """Like post, but ``retry(node)`` runs again at every run boundary until it
        returns True. Pending retries do not stop decode runs from collapsing, so a
        retry must be one that cannot start to succeed inside a run (nothing is
        freed there); one with a deadline must `post` a wake-up at it."""
        def first(node: SimNode) -> None:
            if not retry(node):
                node.retries.append(retry)
        self.post(first, keeps_batch=keeps_batch)

    def lend(self) -> None:
        """Lent to another node's split prefill (idle now): no step until `unlend`."""
        self.lent = self.dirty = True

    def unlend(self) -> None:
        self.lent, self.dirty = False, True
        self._kick()

    def _kick(self) -> None:
        if not self._start_pending and self._run is None:
            self._start_pending = True
            self.loop.at(self.loop.now, self._start)

    def _cut_run(self) -> None:
        run = self._run
        if run is not None and len(run.ends) > 1:
            self._end_after(run, self._in_flight(run))

    def _in_flight(self, run: _Run) -> int:
        """Index of the step of ``run`` in flight now (the next to end)."""
        return int(np.searchsorted(run.ends, self.loop.now, side="left"))

    def _end_after(self, run: _Run, j: int) -> None:
        """End ``run`` with its step ``j`` (nothing to do if it ends there already)."""
        if j + 1 < len(run.ends):
            run.ends = run.ends[:j + 1]
            self._gen += 1
            self.loop.at(float(run.ends[-1]), self._end, self._gen)

    # ---- one step or run -----------------------------------------------------
    def _start(self) -> None:
        self._start_pending = False
        if self._run is not None or self.lent:
            return
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return
        now = self.loop.now
        k = self._collapsible_steps(sched) if self.collapse else 1
        if k > 1:
            ctx = [s.request.num_computed_tokens + 1 for s in sched.seqs]
            ends = now + np.cumsum(self.cost.decode_run(len(ctx), sum(ctx), k, max(ctx)))
        else:
            t = self.cost.step_seconds(sched)
            if self.step_cost is not None:
                t = self.step_cost(self, sched, t)
            if self.slowdown is not None:
                if self.jitter is not None:
                    t *= self.jitter(self, sched)
                self._left, self._since, self._factor = t, now, self.slowdown(self, sched)
                t *= self._factor
            ends = np.array([now + t])
        self._run = _Run(sched, ends, now)
        self._gen += 1
        self.events += 1
        self.loop.at(float(ends[-1]), self._end, self._gen)
        self._busy_changed()

    def retime(self) -> None:
        """The host's load changed: the step in flight goes on at the new speed."""
        run = self._run
        if run is None or self.slowdown is None:
            return
        now = self.loop.now
        self._left = max(0.0, self._left - (now - self._since) / self._factor)
        self._since, self._factor = now, self.slowdown(self, run.sched)
        run.ends[0] = now + self._left * self._factor
        self._gen += 1
        self.loop.at(float(run.ends[0]), self._end, self._gen)

    def _busy_changed(self) -> None:
        if self.on_busy_change is not None and self.busy != self._was_busy:
            self._was_busy = self.busy
            self.on_busy_change(self)

    def _collapsible_steps(self, sched: SchedulerOutput) -> int:
        s = self.scheduler
        if self.inbox or s.num_waiting or sched.preempted_ids \
                or len(sched.seqs) != s.num_running:
            return 1
        k, bs = self.max_run_steps, s.block_size
        for seq in sched.seqs:
            r = seq.request
            c = r.num_computed_tokens
            if seq.num_new_tokens != 1 or not seq.sample or r.hold_kv_on_finish or c < r.num_prompt_tokens:
                return 1
            # ends at its length, or at the step that fills a block: step i (from 0) fills one
            # iff c + 1 + i is a multiple of bs; the next step would need a new block
            k = min(k, r.sampling_params.max_tokens - r.num_output_tokens, (-(c + 1)) % bs + 1)
        return max(k, 1)

    def _end(self, gen: int) -> None:
        if gen != self._gen:
            return
        run, self._run = self._run, None
        ends, k = run.ends, len(run.ends)
        self.busy_s += float(ends[-1]) - run.start
        self.steps += k
        self.dirty = True
        updated = self.scheduler.update_from_output(run.sched, self._sampled)
        if k > 1:
            for r in updated:
                self._advance(r, k - 1)
        if updated:
            self.listener.on_tokens(self, updated, ends)
        t = float(ends[-1])
        for r in updated:
            if r.hold_kv_on_finish or r.num_output_tokens >= r.sampling_params.max_tokens:
                self.scheduler.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
                self.listener.on_finished(self, r, t)
        inbox, self.inbox = self.inbox, []
        for action in inbox:
            action(self)
        if self.retries:
            self.retries = [r for r in self.retries if not r(self)]
        self._start()
        self._busy_changed()

    def _advance(self, r: Request, m: int) -> None:
        """``m`` more decode steps of ``r``: what update_from_output does per step.
        No allocation: a run ends at the step that fills a block, so its table
        already holds every token the run computes."""
        r.num_computed_tokens += m
        r.output_token_ids.extend([self.output_token] * m)
        self.scheduler.kv.cache_blocks(r, r.num_computed_tokens)

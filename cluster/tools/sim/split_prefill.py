"""Splitting one long cold prefill over a group of prefill nodes (cpp36): a what-if, off by default.

Mooncake's "chunked pipeline parallelism" spreads a long prompt's prefill over
``k`` prefill nodes: the model's layers are split into ``k`` stages, one per
node, and the prompt's chunks flow through them, so ``C`` chunks finish in
``C + k - 1`` stage-times, ``(C + k - 1) / k`` chunk-times instead of ``C``.
(Context parallelism, splitting the tokens and exchanging K/V per layer, has a
similar bound.) pdserve does not have it; this models it in the simulator.

When a prefill node A first schedules a request (its admission: the first step
giving it tokens) whose uncached prompt tokens are at least ``min_tokens``, and
``k - 1`` other prefill nodes are idle (nothing running, nothing waiting, not
already lent), those helpers are lent to it: they take no step until its
prefill ends (its first token), and their load reports count the prefill's
remaining tokens as queued (what they are busy with); the lent time counts in
their busy seconds. A computes the prompt as
before (its own scheduler, chunks, other requests in the same steps) and ends
holding the whole prefix, so later turns hit on A; only the time changes.

Time. ``alone``: the request's uncached tokens on an idle node, chunk by chunk
(the cost model's pure prefill, chunks of ``max_num_batched_tokens``, as
benchmarks/routing_tail.py's ``alone``). The pipeline's ``C`` chunks of
``chunk_tokens`` (default ``max_num_batched_tokens``) take ``t_c = alone / C``
each on one node, ``t_c / k`` per stage; with a hand-off of ``h`` seconds
between stages (``hidden_size x chunk_tokens x activation_bytes`` over a link of
``link_gbps``) the group computes the prompt in
``T = t_c + (k - 1) h + (C - 1) max(t_c / k, h)``; with no link cost
(``link_gbps = 0``, the optimistic bound) ``T = alone (C + k - 1) / (k C)``.
The costed variant (``link_gbps > 0``) also prices a pipeline chunk smaller
than ``max_num_batched_tokens`` at its own size: ``t_c`` is then the request's
uncached tokens in chunks of ``chunk_tokens`` on an idle node (the profile's
per-step cost included), over ``C``.
Each of A's steps carrying a chunk of the request then costs its normal time
minus ``(1 - T / alone)`` x that chunk's pure-prefill time (other requests'
tokens in the step keep their cost). With a link, the step that finishes the
prompt also pays the copy of the helpers' layers' KV to A (``(k - 1) / k`` of
the profile's ``kv_bytes_per_token`` per uncached token, one link, serialised)
-- counted in the TTFT, which is conservative: the first token exists before
the copy ends. Nothing else in the simulator changes with the option off.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.tools.sim.cost_model import CostModel, prefill_alone_s
from engine.request import Request
from engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from cluster.tools.sim.node import SimNode


@dataclass(frozen=True)
class SplitPrefill:
    min_tokens: int                  # a prefill of at least this many uncached tokens is split
    nodes: int = 2                   # k: the request's node and k - 1 idle helpers
    chunk_tokens: int = 0            # the pipeline's chunk; 0: the nodes' max_num_batched_tokens
    link_gbps: float = 0.0           # link between stages, Gbit/s; 0: no transfer cost (the optimistic bound)
    hidden_size: int = 576           # SmolLM2-135M
    activation_bytes: int = 4        # fp32

    def __post_init__(self) -> None:
        if self.min_tokens < 1:
            raise ValueError(f"split_prefill.min_tokens must be >= 1 uncached tokens (leave split_prefill "
                             f"None to turn splitting off), got {self.min_tokens}")
        if self.nodes < 2:
            raise ValueError(f"split_prefill.nodes must be >= 2 (the request's node and at least one "
                             f"helper), got {self.nodes}")
        if self.chunk_tokens < 0 or self.link_gbps < 0 or self.hidden_size < 1 or self.activation_bytes < 1:
            raise ValueError("split_prefill: chunk_tokens >= 0 (0: max_num_batched_tokens), link_gbps >= 0 "
                             "(0: no transfer cost), hidden_size and activation_bytes >= 1")

    def handoff_s(self, chunk: int) -> float:
        """One chunk's activations from one stage to the next."""
        if not self.link_gbps:
            return 0.0
        return self.hidden_size * chunk * self.activation_bytes / (self.link_gbps * 1e9 / 8)

    def kv_copy_s(self, uncached: int, kv_bytes_per_token: int) -> float:
        """The helpers' layers' KV of the computed tokens, copied to the request's node."""
        if not self.link_gbps:
            return 0.0
        return uncached * kv_bytes_per_token * (self.nodes - 1) / self.nodes / (self.link_gbps * 1e9 / 8)

    def group_seconds(self, alone: float, uncached: int, chunk: int) -> float:
        """The prompt's compute time on the group (the copy of the KV not included)."""
        c = max(1, math.ceil(uncached / chunk))
        k, t_c, h = self.nodes, alone / c, self.handoff_s(chunk)
        return t_c + (k - 1) * h + (c - 1) * max(t_c / k, h)


@dataclass
class _Split:
    request: Request
    helpers: list["SimNode"]
    scale: float                     # T / alone: each of its chunks' pure-prefill time is scaled by this
    copy_s: float
    since: float                     # when the helpers were lent


class SplitPrefills:
    """The option's state in one ClusterSim: which requests are split, which nodes are lent."""

    def __init__(self, config: SplitPrefill, cost: CostModel, max_num_batched_tokens: int, sim) -> None:
        self.config, self.cost, self.step_tokens, self.sim = config, cost, max_num_batched_tokens, sim
        self.chunk = config.chunk_tokens or max_num_batched_tokens
        self.active: dict[str, _Split] = {}
        self.seen: set[str] = set()          # admitted on a prefill node, prefill not ended
        self.lent: dict[str, str] = {}       # helper node id -> request id
        self.splits = 0
        self.split_ids: set[str] = set()     # every request split (for per-request breakdowns)
        self.lent_s = 0.0

    def _idle_helpers(self, node: "SimNode") -> list["SimNode"]:
        out = []
        for nid in sorted(self.sim.nodes):
            n = self.sim.nodes[nid]
            s = n.scheduler
            if n is node or n.role != "prefill" or nid in self.sim.draining or nid in self.lent or n.busy \
                    or n.inbox or s.num_waiting or s.num_running:
                continue
            out.append(n)
            if len(out) == self.config.nodes - 1:
                break
        return out

    def step_seconds(self, node: "SimNode", sched: SchedulerOutput, t: float) -> float:
        """SimNode's step-cost hook: ``t`` (the cost model's) for this step of ``node``."""
        if node.role != "prefill":
            return t
        for seq in sched.seqs:
            r = seq.request
            if r.num_computed_tokens >= r.num_prompt_tokens:
                continue                                  # a decode (none on a prefill node)
            rid = r.request_id
            if rid not in self.seen:
                self.seen.add(rid)
                self._maybe_split(node, r)
            sp = self.active.get(rid)
            if sp is None:
                continue
            own = self.cost.pure_prefill(seq.num_new_tokens, r.num_computed_tokens)
            t = max(0.0, t - (1.0 - sp.scale) * own)
            if r.num_computed_tokens + seq.num_new_tokens >= r.num_prompt_tokens:
                t += sp.copy_s
            for h in sp.helpers:
                h.dirty = True                            # its reported load follows the prefill
        return t

    def _maybe_split(self, node: "SimNode", r: Request) -> None:
        cached = r.num_computed_tokens
        uncached = r.num_prompt_tokens - cached
        if uncached < self.config.min_tokens:
            return
        helpers = self._idle_helpers(node)
        if len(helpers) < self.config.nodes - 1:
            return
        alone = prefill_alone_s(self.cost.pure_prefill, self.step_tokens, r.num_prompt_tokens, cached)
        if alone <= 0:
            return
        # costed: the pipeline's chunks at their own size's cost (per-step overhead, attention)
        piped = alone if not self.config.link_gbps or self.chunk == self.step_tokens else \
            prefill_alone_s(self.cost.pure_prefill, self.chunk, r.num_prompt_tokens, cached)
        scale = self.config.group_seconds(piped, uncached, self.chunk) / alone
        copy_s = self.config.kv_copy_s(uncached, self.cost.kv_bytes_per_token)
        now = self.sim.loop.now
        self.active[r.request_id] = _Split(r, helpers, scale, copy_s, now)
        self.splits += 1
        self.split_ids.add(r.request_id)
        for h in helpers:
            self.lent[h.node_id] = r.request_id
            h.lend()

    def queued_tokens(self, node_id: str) -> int:
        """What a lent helper reports as queued: the split prefill's remaining tokens (0 if not lent)."""
        rid = self.lent.get(node_id)
        if rid is None:
            return 0
        r = self.active[rid].request
        return max(0, r.num_prompt_tokens - r.num_computed_tokens)

    def prefill_ended(self, request_id: str) -> None:
        """Its first token: the helpers go back to their own queues."""
        self.seen.discard(request_id)
        sp = self.active.pop(request_id, None)
        if sp is None:
            return
        now = self.sim.loop.now
        for h in sp.helpers:
            del self.lent[h.node_id]
            h.busy_s += now - sp.since
            self.lent_s += now - sp.since
            h.unlend()

    def summary(self) -> dict:
        c = self.config
        return {"min_tokens": c.min_tokens, "nodes": c.nodes, "chunk_tokens": self.chunk,
                "link_gbps": c.link_gbps, "splits": self.splits, "helper_lent_s": round(self.lent_s, 3)}

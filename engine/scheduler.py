"""Token-budget continuous batching, FCFS by default, with automatic prefix caching.

Each step spends a budget of ``max_num_batched_tokens`` tokens: first on
running requests (decodes and continuing chunked prefills, oldest arrival
first), then on waiting requests in FCFS order (or ``queue_order``'s:
engine/queue_order.py), skipping one whose next prompt blocks a running
request is computing right now (it waits for them as prefix hits:
engine/prefix_wait.py). With ``final_chunk_unpadded`` a step that carries a
prompt's last prefill chunk is not filled up with chunks that would not finish
their prompt in it (newcomers' first chunks): those run in the next step at the
same cost where a step's time is linear in its tokens, and the finishing
prompt's first token does not wait for them. A request computes the
tokens between ``num_computed_tokens`` and ``num_tokens``; prefill, decode and
"KV arrived from a remote node" are the same case. When the pool runs out,
the most recently arrived running request is preempted: by swap to the host
tier or by recompute, as ``preemption`` (a cost rule) chooses per request.

Protocol (one engine step): ``schedule()`` -> model runner -> sampler ->
``update_from_output()`` -> stop checks -> ``finish_request()``.

Who frees a request's blocks: ``finish_request`` (unless the request holds
its KV for a remote reader; then exactly one ``release_held`` or
``abort_request``), ``abort_request`` in any state, preemption, and
``remote_kv_failed``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from engine.block_manager import ComputedBlocks, KVCacheManager, cdiv
from engine.block_pool import IntegrityError
from engine.config import CacheConfig, SchedulerConfig
from engine.prefix_wait import PrefixWaits
from engine.queue_order import make_queue_order
from engine.request import Request, RequestStatus
from engine.request_queues import RequestQueues
from engine.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.scheduler_remote import RemoteAllocation, RemoteKVMixin
from engine.tiers.cost import PreemptionMode, PreemptionPolicy
from engine.tiers.types import TierSizes

__all__ = ["RemoteAllocation", "Scheduler"]


@dataclass(slots=True)
class _StepBudget:
    tokens: int
    seqs: int
    prefill_closed: bool = False    # final_chunk_unpadded: a prefill finishes in this step; no partial chunk joins

    @property
    def exhausted(self) -> bool:
        return self.tokens <= 0 or self.seqs <= 0

    def take(self, num_tokens: int) -> None:
        self.tokens -= num_tokens
        self.seqs -= 1


def _is_decode(request: Request) -> bool:
    """One token left to compute and a token already sampled: a decode, not a prompt's chunk."""
    return request.num_tokens - request.num_computed_tokens == 1 and request.num_output_tokens > 0


class Scheduler(RemoteKVMixin):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_model_len: int, clock: Callable[[], float] = time.monotonic, *,
                 tier_sizes: TierSizes = TierSizes(), preemption: PreemptionPolicy | None = None) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                 tier_sizes, cache_config.kv_cache_dtype)
        self.preemption = preemption or PreemptionPolicy()
        self.prefix_waits = PrefixWaits(cache_config.block_size, cache_config.enable_prefix_caching)
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        self._clock = clock
        self.queues = RequestQueues()
        self.waiting = self.queues.waiting          # FCFS unless config.queue_order says otherwise
        self._order = make_queue_order(scheduler_config.queue_order, scheduler_config.queue_max_pass_s)
        self.running = self.queues.running          # sorted by arrival, oldest first

    # ---- admission -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._register(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self._order.added(request.request_id, self._clock)

    def _register(self, request: Request) -> None:
        rid = request.request_id
        total = request.num_prompt_tokens + request.sampling_params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                             f"({request.sampling_params.max_tokens}) = {total} exceeds max_model_len "
                             f"{self.max_model_len}; shorten the prompt or lower max_tokens")
        if cdiv(total, self.block_size) > self.kv.num_blocks:
            raise ValueError(f"request {rid!r} needs {cdiv(total, self.block_size)} KV blocks but the pool "
                             f"has {self.kv.num_blocks}; lower max_tokens or give the KV pool more memory")
        if not self.config.enable_chunked_prefill and total > self.config.max_num_batched_tokens:
            raise ValueError(f"request {rid!r} may need {total} tokens in one step but "
                             f"max_num_batched_tokens is {self.config.max_num_batched_tokens}; "
                             "enable chunked prefill or raise max_num_batched_tokens")
        self.queues.register(request)
        request.max_total_tokens = total

    # ---- one step ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _StepBudget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self._schedule_running(out, budget)
        if not out.preempted_ids:
            self._schedule_waiting(out, budget)
        out.kv_moves = self.kv.take_kv_moves()
        out.block_copies = [(m.src, m.dst) for m in out.kv_moves if m.is_copy]
        return out

    def _chunk(self, remaining: int, budget: _StepBudget) -> int:
        if self.config.enable_chunked_prefill:
            return min(remaining, budget.tokens)
        return remaining if remaining <= budget.tokens else 0

    def _schedule_running(self, out: SchedulerOutput, budget: _StepBudget) -> None:
        i = 0
        while i < len(self.running) and not budget.exhausted:
            request = self.running[i]
            n = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            if n > 0 and not (budget.prefill_closed and n < request.num_tokens - request.num_computed_tokens):
                block_ids = self._allocate_or_preempt(request, n, out)
                if block_ids is None:      # it preempted itself: it was the last one
                    return
                self._add(out, budget, self._seq(request, n, block_ids))
            i += 1

    def _add(self, out: SchedulerOutput, budget: _StepBudget, seq: ScheduledSeq) -> None:
        """Put ``seq`` in the step; with ``final_chunk_unpadded`` a prefill's last chunk closes the
        step to chunks that would not finish their prompt in it (whole prompts and decodes still join)."""
        out.seqs.append(seq)
        budget.take(seq.num_new_tokens)
        if self.config.final_chunk_unpadded and seq.sample and not _is_decode(seq.request):
            budget.prefill_closed = True

    def _allocate_or_preempt(self, request: Request, n: int, out: SchedulerOutput) -> list[int] | None:
        while (block_ids := self.kv.allocate_slots(request, n)) is None:
            victim = self.running[-1]       # most recently arrived; not yet scheduled this step
            self._preempt(victim, out)
            if victim is request:
                return None
        return block_ids

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        num_blocks = cdiv(request.num_computed_tokens, self.block_size)
        mode = self.preemption.choose(num_blocks, request.num_computed_tokens)
        if mode is PreemptionMode.SWAP and self.kv.swap_out(request):
            self.num_swap_preemptions += 1
        else:
            self.kv.free(request)
            self.num_recompute_preemptions += 1
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_ids.append(request.request_id)

    def _schedule_waiting(self, out: SchedulerOutput, budget: _StepBudget) -> None:
        """Admit waiting requests in queue order (FCFS, or config.queue_order's); one
        whose next prompt blocks a running request is computing now is skipped
        (engine/prefix_wait.py)."""
        pending: dict[int, str] | None = None       # built on first need
        if self.waiting and not budget.exhausted and len(self.running) < self.config.max_num_seqs:
            self._order.arrange(self.waiting,
                                lambda r: r.num_tokens - self.kv.get_computed_blocks(r).num_computed_tokens,
                                self._clock)
        i = 0
        while i < len(self.waiting) and not budget.exhausted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[i]
            computed = self.kv.get_computed_blocks(request)
            if pending is None:
                pending = self.prefix_waits.pending(self.running)
            if self.prefix_waits.should_wait(request, computed, pending):
                i += 1
                continue
            n = self._chunk(request.num_tokens - computed.num_computed_tokens, budget)
            if n == 0 or (budget.prefill_closed and n < request.num_tokens - computed.num_computed_tokens):
                return
            block_ids = self.kv.allocate_slots(request, n, computed)
            if block_ids is None:
                return
            del self.waiting[i]
            self._admit(request, computed, pending)
            self._add(out, budget, self._seq(request, n, block_ids))

    def _admit(self, request: Request, computed: ComputedBlocks, pending: dict[int, str]) -> None:
        request.num_computed_tokens = computed.num_computed_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = computed.num_computed_tokens
        self.queues.start_running(request)
        self.prefix_waits.admitted(request, computed)
        self.prefix_waits.add_owner(pending, request)

    def _seq(self, request: Request, n: int, block_ids: list[int]) -> ScheduledSeq:
        return ScheduledSeq(request, n, block_ids, sample=request.num_computed_tokens + n == request.num_tokens)

    def update_from_output(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance each scheduled request; append sampled tokens; cache newly
        full blocks. Returns the requests that got new tokens (for stop checks).
        Requests finished or aborted since ``schedule()`` are skipped."""
        updated = []
        live, cache_blocks, running = self.queues.get, self.kv.cache_blocks, RequestStatus.RUNNING
        for seq in sched.seqs:
            request = seq.request
            if live(request.request_id) is not request or request.status is not running:
                continue
            request.num_computed_tokens += seq.num_new_tokens
            if seq.sample:
                tokens = sampled.get(request.request_id)
                if not tokens:
                    raise ValueError(f"request {request.request_id!r} was scheduled with sample=True "
                                     "but `sampled` has no token for it; pass one per sampled seq")
                request.output_token_ids.extend(tokens)
                updated.append(request)
            cache_blocks(request, request.num_computed_tokens)
        return updated

    # ---- ending requests -----------------------------------------------------

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """End a live request: free its blocks, or hold them when the request
        asks to (``hold_kv_on_finish``, not for aborts). False if unknown."""
        if not status.finished:
            raise ValueError(f"finish_request needs a FINISHED_* status, got {status.name}")
        request = self.queues.get(request_id)
        if request is None:
            return False
        self.queues.remove(request)
        self.prefix_waits.forget(request_id)
        request.status = status
        if request.hold_kv_on_finish and status != RequestStatus.FINISHED_ABORTED:
            self.queues.held[request_id] = (request, self._clock())
        else:
            self.kv.free(request)
        return True

    def abort_request(self, request_id: str) -> bool:
        """Abort in any state (waiting, running, remote, held); frees its blocks."""
        if request_id in self.queues.held:
            return self.release_held(request_id)
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def release_held(self, request_id: str) -> bool:
        """Free a held request's blocks; exactly once (False afterwards)."""
        entry = self.queues.held.pop(request_id, None)
        if entry is None:
            return False
        self.kv.free(entry[0])
        return True

    def held_since(self, request_id: str) -> float | None:
        entry = self.queues.held.get(request_id)
        return entry[1] if entry else None

    # ---- n > 1 ---------------------------------------------------------------

    def fork_request(self, parent_id: str, child: Request) -> None:
        """Add ``child`` (same prompt, its own sampled tokens) sharing the
        parent's computed blocks copy-on-write. Before the parent has computed
        anything the child is simply queued (the prefix cache shares later)."""
        parent = self.queues.get(parent_id)
        if parent is None:
            raise ValueError(f"unknown request {parent_id!r}: fork a live request")
        if child.prompt_token_ids != parent.prompt_token_ids:
            raise ValueError(f"child {child.request_id!r} must have the same prompt as {parent_id!r}")
        if parent.status != RequestStatus.RUNNING or parent.num_computed_tokens == 0:
            self.add_request(child)
            return
        shared = min(parent.num_computed_tokens, child.num_tokens - 1)
        if child.all_token_ids[:shared] != parent.all_token_ids[:shared]:
            raise ValueError(f"child {child.request_id!r} must repeat the parent's first {shared} tokens")
        self._register(child)
        child.num_computed_tokens = shared
        child.num_cached_tokens = parent.num_cached_tokens
        self.kv.fork(parent, child)
        self.queues.start_running(child)

    # ---- state ---------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_remote(self) -> int:
        return len(self.queues.remote)

    @property
    def num_held(self) -> int:
        return len(self.queues.held)

    @property
    def num_waiting_tokens(self) -> int:
        """Prefill tokens still queued: all uncomputed tokens of waiting
        requests, plus the unfinished prefill of running ones (not decodes)."""
        queued = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return queued + sum(n for r in self.running if (n := r.num_tokens - r.num_computed_tokens) > 1)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    def has_unfinished(self) -> bool:
        return len(self.queues) > 0

    def unstarted_request_ids(self) -> list[str]:
        """Waiting single-sample requests that have computed nothing yet, in queue order."""
        return [r.request_id for r in self.waiting
                if r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 and r.sampling_params.n == 1]

    def get_request(self, request_id: str) -> Request | None:
        return self.queues.get(request_id)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        errors = self.queues.check(self.kv.get_block_ids, self.kv.owners(), self.block_size)
        for rid in self.kv.swapped_ids():
            request = self.queues.get(rid)
            if request is None or request.status != RequestStatus.PREEMPTED or request not in self.waiting:
                errors.append(f"swapped-out request {rid} is not waiting as PREEMPTED")
        if errors:
            raise IntegrityError("scheduler: " + "; ".join(errors))

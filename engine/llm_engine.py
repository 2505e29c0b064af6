"""One node's engine: scheduler -> model runner -> sampler -> stop checks.

`step()` runs one batched forward for every scheduled sequence and returns
a `StepDelta` per sequence that produced a token. The same engine serves
three roles: colocated (prefill and decode), prefill (`prefill_only=True`:
finish after the first token and hold the KV for a remote reader) and
decode (`add_remote_request` + `remote_kv_ready` once the KV has landed).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Iterable

import torch

from engine.config import EngineConfig
from engine.engine_stats import EngineStats, prefix_wait_stats, tier_stats
from engine.kv_events import KVEvent, KVSnapshot
from engine.layer_progress import Emit, device_sync, layer_marks, layer_reporter
from engine.model_runner import ModelRunner
from engine.outputs import StepDelta
from engine.request import RequestStatus
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import RemoteAllocation, Scheduler
from engine.sequence import SeqGroup, Sequence, make_sequence
from engine.step_trace import StepShape
from engine.thread_pinning import ThreadPinner
from engine.tiers.cost import PreemptionPolicy, ThroughputMeter
from engine.tokenizer import Tokenizer

log = logging.getLogger("pdserve.engine")

MAX_BUFFERED_EVENTS = 1 << 16
# a prefill-only request finishes after its first token with no finish reason (None): "length"
_FINISH_STATUS: dict[str | None, RequestStatus] = {"stop": RequestStatus.FINISHED_STOPPED,
                                                   "length": RequestStatus.FINISHED_LENGTH}


class QueueFull(RuntimeError):
    """The engine's waiting queue holds ``SchedulerConfig.max_waiting`` requests:
    send the request to another engine, or retry later. Nothing was queued."""


class LLMEngine:
    def __init__(self, config: EngineConfig, *, runner: ModelRunner | None = None,
                 tokenizer: Tokenizer | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        from engine.loader.load import resolve_model_path

        self.config = config
        self._clock = clock
        self.model_path = resolve_model_path(config.model or None)
        if runner is None:
            runner = _build_runner(config if config.model else _with_model(config, str(self.model_path)))
        self.runner = runner
        try:
            self.tokenizer = tokenizer or Tokenizer.load(self.model_path)
        except BaseException:
            runner.close()
            raise
        self.max_model_len = runner.max_model_len
        # ids a prompt may hold: the model's embedding rows, which can outnumber the tokenizer's
        # tokens (padded vocabularies, as Qwen2 checkpoints have). The model samples from them
        # too, so a continuation (prompt + ids it produced) must pass. vLLM likewise accepts ids
        # up to max(tokenizer, model) - 1; we take the model's, since an id past the embedding
        # cannot be run (there are no placeholder ids swapped out before the embedding here).
        self.vocab_size = runner.model_config.vocab_size
        self.block_size = runner.block_size
        # preemption: swap vs recompute at measured host bandwidth / prefill speed
        self.prefill_speed = ThroughputMeter()
        policy = PreemptionPolicy(config.cache.preemption_mode, runner.kv_pool.bytes_per_block,
                                  runner.tiers.bandwidth, self.prefill_speed)
        self.scheduler = Scheduler(config.scheduler, config.cache, runner.num_blocks, self.max_model_len,
                                   clock=clock, tier_sizes=runner.tiers.sizes, preemption=policy)
        generator = torch.Generator(device=runner.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator)
        self._groups: dict[str, SeqGroup] = {}
        self._seqs: dict[str, Sequence] = {}       # scheduler request id -> sequence
        self._num_preemptions = 0
        self.last_step_tokens = 0                   # tokens computed by the last step()
        self.record_step_shapes = False             # set by a step trace: keep each step's shape
        self.last_step_shape: StepShape | None = None
        # KV events for the router, bounded: a consumer that falls behind sees an
        # event-id gap and resyncs from kv_snapshot()
        self._events: deque[KVEvent] = deque(maxlen=MAX_BUFFERED_EVENTS)
        # layer progress of prompts a step completes (prefill role); not with tensor parallelism,
        # where rank 0's layers say nothing of the other ranks'
        groups = config.prompt_layer_groups if config.tensor_parallel_size == 1 else 1
        self._layer_marks = layer_marks(runner.model_config.num_layers, groups)
        self._device_sync = device_sync(runner.device)
        self.thread_pinner = ThreadPinner(config.omp_threads_bind)   # pins on each stepping thread's first step
        log.info("KV pool: %s", runner.kv_pool.describe())

    @classmethod
    def from_model(cls, model: str | None = None, **kwargs) -> "LLMEngine":
        return cls(EngineConfig(model=model or "", **kwargs))

    # ------------------------------------------------------------------ input
    def add_request(self, request_id: str, prompt_token_ids: Iterable[int], params: SamplingParams,
                    cache_salt: str | None = None, *, prefill_only: bool = False,
                    arrival_time: float | None = None, bounded: bool = True) -> None:
        """Queue a request. ValueError (nothing changed) for a bad input; QueueFull
        (nothing changed) when ``max_waiting`` requests already wait, unless
        ``bounded`` is False (a request this engine had already accepted)."""
        if bounded:
            self.check_room()
        group = self._new_group(request_id, prompt_token_ids, params, cache_salt, prefill_only,
                                arrival_time)
        self.scheduler.add_request(group.seqs[0].request)
        self._register(group)

    def check_room(self, elsewhere: int = 0) -> None:
        """QueueFull if ``max_waiting`` requests wait here, counting ``elsewhere``
        requests queued for this engine outside it (e.g. waiting for KV room)."""
        cap = self.config.scheduler.max_waiting
        n = self.scheduler.num_waiting + elsewhere
        if cap and n >= cap:
            raise QueueFull(f"{n} requests already wait here (max_waiting {cap}): send the request "
                            "to another worker or retry later")

    def add_remote_request(self, request_id: str, prompt_token_ids: Iterable[int],
                           params: SamplingParams, first_token: int | None = None,
                           cache_salt: str | None = None,
                           arrival_time: float | None = None) -> RemoteAllocation | None:
        """Decode role: reserve blocks for a prompt prefilled elsewhere. Returns
        which local blocks to fill (local prefix hits excluded) or None when
        there is no room now. `first_token` is the token the prefill node
        sampled; None reserves ahead of it (while the prompt is still being
        prefilled) and `remote_kv_ready` then brings it."""
        if params.n != 1:
            raise ValueError("n > 1 requests are prefilled on the decode node; do not hand them off")
        group = self._new_group(request_id, prompt_token_ids, params, cache_salt, False, arrival_time)
        seq = group.seqs[0]
        if first_token is not None:
            self.tokenizer.validate_token_ids([first_token], self.vocab_size)   # the model's, not the tokenizer's
        alloc = self.scheduler.add_remote_request(seq.request)
        if alloc is None:
            return None
        # page-ins / page-outs land before the pull writes into the blocks
        self.runner.apply_kv_moves(self.scheduler.kv.take_kv_moves())
        group.forked = True
        self._register(group)
        if first_token is not None:
            self._set_first_token(seq, first_token)
        return alloc

    def remote_kv_ready(self, request_id: str, first_token: int | None = None) -> bool:
        """The prompt's KV landed: decode on. `first_token` must be given here if it
        was not at `add_remote_request`. False if the request was aborted meanwhile."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        if first_token is not None:
            self.tokenizer.validate_token_ids([first_token], self.vocab_size)   # the model produced it
            self._set_first_token(seq, first_token)
        if seq.pending_first_token is None:
            raise ValueError(f"request {request_id!r}: its KV is ready but no first token was given; "
                             "pass first_token to add_remote_request or remote_kv_ready")
        self.scheduler.remote_kv_ready(request_id, seq.pending_first_token)
        seq.announce_admission = True
        return True

    @staticmethod
    def _set_first_token(seq: Sequence, first_token: int) -> None:
        seq.stop.process(first_token, seq.detok)   # the prefill node already streamed it
        seq.pending_first_token = first_token

    def remote_kv_failed(self, request_id: str, first_token: int | None = None) -> bool:
        """The pull failed: recompute the prompt here (the first token is kept;
        give it here if it was not given before)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        if first_token is not None:
            self._set_first_token(seq, first_token)
        first = seq.pending_first_token
        if first is None:
            raise ValueError(f"request {request_id!r}: its KV pull failed but no first token was given; "
                             "pass first_token to add_remote_request or remote_kv_failed")
        self.scheduler.remote_kv_failed(request_id)
        seq.request.output_token_ids.append(first)
        return True

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all n samples) wherever it is; frees its blocks."""
        group = self._groups.pop(request_id, None)
        found = False
        seqs = group.seqs if group else []
        for seq in seqs:
            self._seqs.pop(seq.request.request_id, None)
            found |= self.scheduler.abort_request(seq.request.request_id)
        if group is None:
            found |= self.scheduler.release_held(request_id)
        return found or group is not None

    def abort_unstarted(self) -> list[str]:
        """Abort the single-sample requests still queued with nothing computed (no
        token produced, no block written here) and return their ids: a host that
        stops taking work hands these to another engine."""
        return self.give_back(self.scheduler.unstarted_request_ids())

    def give_back(self, request_ids: Iterable[str]) -> list[str]:
        """Of ``request_ids``, abort those still queued with nothing computed (as
        ``abort_unstarted``) and return their ids: a decode pool moves queued work to a worker
        with free slots (cluster/orchestration/rebalance.py)."""
        wanted = set(request_ids)
        ids = [rid for rid in self.scheduler.unstarted_request_ids() if rid in wanted]
        for rid in ids:
            self.abort_request(rid)
        return ids

    # ------------------------------------------------------------------- step
    def has_unfinished(self) -> bool:
        return bool(self._seqs) and self.scheduler.has_unfinished()

    def step(self, on_early: Emit | None = None) -> list[StepDelta]:
        """One engine step: its deltas. `on_early` receives deltas before the step ends: before
        the forward, the tokenless `admitted` deltas of handed-off requests this step takes into
        the batch (without it they lead the returned deltas); during the forward, the layer
        progress of prefill_only prompts this step completes (`prompt_layer_groups` > 1;
        without it none is reported)."""
        sched = self.scheduler.schedule()
        self._num_preemptions += len(sched.preempted_ids)
        self.last_step_tokens = sched.num_tokens
        if self.record_step_shapes:
            self.last_step_shape = None if sched.is_empty else StepShape.of(sched)
        if sched.is_empty:
            self.runner.apply_kv_moves(sched.moves())     # e.g. swap-outs of a step that ran nothing
            return []
        admitted = self._admitted(sched)
        if admitted and on_early is not None:
            on_early(admitted)
            admitted = []
        self.thread_pinner.ensure()
        t0 = time.perf_counter()
        logits = self.runner.execute(sched, self._layer_progress(sched, on_early))
        if any(s.num_new_tokens > 1 for s in sched.seqs):
            self.prefill_speed.observe(sched.num_tokens, time.perf_counter() - t0)
        sampled_seqs = [self._seqs[s.request.request_id] for s in sched.seqs if s.sample]
        rows, targets = self._expand_forks(sampled_seqs)
        if len(rows) != len(sampled_seqs):
            logits = logits[torch.tensor(rows, device=logits.device)]
        out = self.sampler.sample(logits, [t.sampling for t in targets])
        sampled = {t.request.request_id: [tok] for t, tok in zip(targets, out.token_ids)
                   if t.index == 0 or self._groups[t.group_id].forked}
        self.scheduler.update_from_output(sched, sampled)
        self._events.extend(self.scheduler.kv.drain_events())
        self._fork_children(targets, out.token_ids)
        return admitted + self._chunk_progress(sched) + [self._finish_token(t, tok, lp)
                                                         for t, tok, lp in zip(targets, out.token_ids, out.logprobs)]

    def _admitted(self, sched) -> list[StepDelta]:
        """Mark first-scheduled sequences (queue time); a tokenless `admitted` delta for each
        handed-off one whose KV landed: this step computes its next token."""
        now, out = self._clock(), []
        for s in sched.seqs:
            seq = self._seqs.get(s.request.request_id)
            if seq is None:
                continue
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            if seq.announce_admission:
                seq.announce_admission = False
                out.append(StepDelta(request_id=seq.group_id, new_token_ids=(), admitted=True,
                                     num_prompt_tokens=seq.request.num_prompt_tokens))
        return out

    def _chunk_progress(self, sched) -> list[StepDelta]:
        """A tokenless delta per prefill_only request that computed a prompt chunk this
        step: the prompt blocks complete so far (see StepDelta.computed_block_ids)."""
        out = []
        for s in sched.seqs:
            seq = self._seqs.get(s.request.request_id)
            if s.sample or seq is None or not self._groups[seq.group_id].prefill_only:
                continue
            req = seq.request
            full = min(req.num_computed_tokens, req.num_prompt_tokens) // self.block_size
            out.append(StepDelta(request_id=seq.group_id, new_token_ids=(), num_prompt_tokens=req.num_prompt_tokens,
                                 computed_block_ids=tuple(self.scheduler.kv.get_block_ids(req.request_id)[:full]),
                                 preemptions=req.num_preemptions))
        return out

    def _layer_progress(self, sched, emit: Emit | None) -> Callable[[int], None] | None:
        """The forward's per-layer callback when this step completes prefill_only prompts
        and layer progress is on (engine/layer_progress.py); else None."""
        if not self._layer_marks or emit is None:
            return None
        deltas = []
        for s in sched.seqs:
            seq = self._seqs.get(s.request.request_id)
            if not s.sample or seq is None or not self._groups[seq.group_id].prefill_only:
                continue
            req = seq.request
            blocks = self.scheduler.kv.get_block_ids(req.request_id)[:-(-req.num_prompt_tokens // self.block_size)]
            deltas.append(StepDelta(request_id=seq.group_id, new_token_ids=(), num_prompt_tokens=req.num_prompt_tokens,
                                    computed_block_ids=tuple(blocks), preemptions=req.num_preemptions))
        return layer_reporter(self._layer_marks, deltas, emit, self._device_sync) if deltas else None

    def _expand_forks(self, seqs: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        rows, targets = [], []
        for i, seq in enumerate(seqs):
            group = self._groups[seq.group_id]
            members = group.seqs if group.needs_fork and seq.index == 0 else [seq]
            for member in members:
                rows.append(i)
                targets.append(member)
        return rows, targets

    def _fork_children(self, targets: list[Sequence], tokens: list[int]) -> None:
        for seq, tok in zip(targets, tokens):
            group = self._groups[seq.group_id]
            if group.forked or seq.index == 0:
                continue
            seq.request.output_token_ids.append(tok)
            self.scheduler.fork_request(group.group_id, seq.request)
            self._seqs[seq.request.request_id] = seq
            if seq.index == len(group.seqs) - 1:
                group.forked = True

    def _finish_token(self, seq: Sequence, token: int, logprob) -> StepDelta:
        req = seq.request
        res = seq.stop.process(token, seq.detok)
        group = self._groups[seq.group_id]
        finished = res.finished or group.prefill_only
        held: tuple[int, ...] = ()
        if finished:
            status = _FINISH_STATUS.get(res.finish_reason, RequestStatus.FINISHED_LENGTH)
            self.scheduler.finish_request(req.request_id, status)
            if group.prefill_only:    # handed out with the token: no second trip to the engine thread
                held = tuple(self.held_block_ids(req.request_id))
            self._seqs.pop(req.request_id, None)
            if not any(s.request.request_id in self._seqs for s in group.seqs):
                self._groups.pop(seq.group_id, None)
        return StepDelta(request_id=seq.group_id, new_token_ids=(token,), index=seq.index,
                         new_text=res.text, finish_reason=res.finish_reason, stop_reason=res.stop_reason,
                         logprobs=(logprob,) if logprob is not None else (),
                         num_prompt_tokens=req.num_prompt_tokens,
                         num_cached_tokens=req.num_cached_tokens or 0,
                         queue_seconds=_queue_seconds(seq), held_block_ids=held,
                         preemptions=req.num_preemptions if group.prefill_only else 0)

    # ---------------------------------------------------------- prefill role
    def held_block_ids(self, request_id: str) -> list[int]:
        return self.scheduler.kv.get_block_ids(request_id)

    def release_held(self, request_id: str) -> bool:
        """Free a prefill_only request's held blocks; exactly once."""
        return self.scheduler.release_held(request_id)

    # ------------------------------------------------------------ inspection
    def stats(self) -> EngineStats:
        s, kv = self.scheduler, self.scheduler.kv
        pc = kv.prefix_cache_stats
        return EngineStats(running=s.num_running, waiting=s.num_waiting, waiting_tokens=s.num_waiting_tokens,
                           remote_waiting=s.num_remote, held=s.num_held,
                           kv_blocks_used=kv.num_blocks - kv.num_free_blocks, kv_blocks_total=kv.num_blocks,
                           prefix_queried_tokens=pc.queried_tokens, prefix_hit_tokens=pc.hit_tokens,
                           preemptions=self._num_preemptions, **tier_stats(self.scheduler, self.runner),
                           **prefix_wait_stats(self.scheduler))

    def drain_kv_events(self) -> list[KVEvent]:
        self._events.extend(self.scheduler.kv.drain_events())
        events = list(self._events)
        self._events.clear()
        return events

    def kv_snapshot(self) -> KVSnapshot:
        return self.scheduler.kv.snapshot()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    @property
    def kv_pool(self):
        return self.runner.kv_pool

    def close(self) -> None:
        """Release the runner (a tensor-parallel runner stops its rank processes); idempotent."""
        self.runner.close()

    # --------------------------------------------------------------- helpers
    def _new_group(self, request_id, prompt_token_ids, params, cache_salt, prefill_only,
                   arrival_time) -> SeqGroup:
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be an engine.SamplingParams")
        if request_id in self._groups or request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use; give each request a unique id")
        prompt = self.tokenizer.validate_token_ids(list(prompt_token_ids), self.vocab_size)
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token or a non-empty string")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt)} tokens but max_model_len is "
                             f"{self.max_model_len}: shorten the prompt to at most {self.max_model_len - 1}")
        if prefill_only and params.n != 1:
            raise ValueError("prefill_only requests must have n == 1")
        seqs = [make_sequence(request_id, i, prompt, params, cache_salt, self.tokenizer, self.max_model_len,
                              self.runner.device, hold_kv=prefill_only, arrival_time=arrival_time)
                for i in range(params.n)]
        return SeqGroup(request_id, seqs, forked=params.n == 1, prefill_only=prefill_only)

    def _register(self, group: SeqGroup) -> None:
        self._groups[group.group_id] = group
        self._seqs[group.seqs[0].request.request_id] = group.seqs[0]


def _build_runner(config: EngineConfig) -> ModelRunner:
    if config.tensor_parallel_size > 1:
        from engine.parallel.executor import TPExecutor
        return TPExecutor.start(config)
    return ModelRunner.from_engine_config(config)


def _with_model(config: EngineConfig, model: str) -> EngineConfig:
    from dataclasses import replace
    return replace(config, model=model)


def _queue_seconds(seq: Sequence) -> float | None:
    """Arrival to first scheduling, reported once: with the sequence's first token."""
    if seq.stop.num_output_tokens != 1 or seq.first_scheduled is None or seq.pending_first_token is not None:
        return None
    return max(0.0, seq.first_scheduled - seq.request.arrival_time)

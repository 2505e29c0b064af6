"""Per-sequence bookkeeping the engine keeps beside the scheduler's Request:
sampling state, streaming detokenizer and stop checker. A `SeqGroup` is
one user request: n sequences sampled from one prompt (n > 1 forks
copy-on-write after the prompt's first token)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from engine.detokenizer import IncrementalDetokenizer
from engine.request import Request
from engine.sampler import SamplingState
from engine.stop_checker import StopChecker


@dataclass
class Sequence:
    request: Request
    group_id: str
    index: int
    sampling: SamplingState
    detok: IncrementalDetokenizer
    stop: StopChecker
    pending_first_token: int | None = None   # decode role: token the prefill node sampled
    first_scheduled: float | None = None     # engine clock when first scheduled (queue time)
    announce_admission: bool = False         # decode role: KV landed; say so when a step first schedules it


@dataclass
class SeqGroup:
    group_id: str
    seqs: list[Sequence]
    forked: bool = False        # children (index > 0) joined the scheduler
    prefill_only: bool = False  # prefill role: finish after the first token, hold the KV

    @property
    def needs_fork(self) -> bool:
        return not self.forked and len(self.seqs) > 1


def child_request_id(group_id: str, index: int) -> str:
    return group_id if index == 0 else f"{group_id}#{index}"


def make_sequence(group_id: str, index: int, prompt_ids: list[int], params, cache_salt,
                  tokenizer, max_model_len: int, device, hold_kv: bool = False,
                  arrival_time: float | None = None) -> Sequence:
    """Build one sequence of a group. Seeded samples get seed + index so the n
    samples differ yet each reproduces."""
    if params.seed is not None and index:
        params = replace(params, seed=params.seed + index)
    req = Request(child_request_id(group_id, index), list(prompt_ids), params, cache_salt=cache_salt,
                  sample_index=index, hold_kv_on_finish=hold_kv,
                  arrival_time=time.monotonic() if arrival_time is None else arrival_time)
    sampling = SamplingState.create(params, req.prompt_token_ids, req.output_token_ids, device=device)
    detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids)
    stop = StopChecker(params, tokenizer.eos_token_ids, num_prompt_tokens=req.num_prompt_tokens,
                       max_total_tokens=max_model_len)
    return Sequence(req, group_id, index, sampling, detok, stop)

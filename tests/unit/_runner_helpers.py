"""Hand-built SchedulerOutputs for model-runner tests (no scheduler needed)."""
from __future__ import annotations

import torch

from engine.config import CacheConfig
from engine.loader import load_model_source
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledSeq, SchedulerOutput


def make_runner(model_dir, *, block_size: int = 4, num_blocks: int = 96, dtype="float32",
                max_model_len: int | None = 256) -> ModelRunner:
    cfg, sd = load_model_source(model_dir)
    return ModelRunner(cfg, sd, cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                       max_model_len=max_model_len, device="cpu", dtype=dtype)


def request(rid: str, prompt: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt),
                   sampling_params=SamplingParams(max_tokens=64, temperature=0.0))


def sched_seq(req: Request, n: int, blocks: list[int]) -> ScheduledSeq:
    return ScheduledSeq(request=req, num_new_tokens=n, block_ids=blocks,
                        sample=req.num_computed_tokens + n == req.num_tokens)


def step(runner: ModelRunner, seqs: list[ScheduledSeq], copies=()) -> torch.Tensor:
    """Execute one step and advance ``num_computed_tokens``; logits of sampled seqs."""
    logits = runner.execute(SchedulerOutput(seqs=list(seqs), block_copies=list(copies)))
    for s in seqs:
        s.request.num_computed_tokens += s.num_new_tokens
    return logits


def step_all_positions(runner: ModelRunner, seqs: list[ScheduledSeq]) -> list[torch.Tensor]:
    """Like :func:`step` but returns logits of every computed token, per seq in ``seqs`` order."""
    inputs = runner.build_inputs(SchedulerOutput(seqs=list(seqs)))
    batch = inputs.batch
    # the runner orders prefill-like first: recover each seq's token range
    order = sorted(seqs, key=lambda s: s.num_new_tokens == 1 and s.sample)
    starts, pos = {}, 0
    for s in order:
        starts[id(s)] = pos
        pos += s.num_new_tokens
    batch.logits_indices = torch.arange(pos)
    with torch.inference_mode():
        logits = runner.model(batch, runner.kv_pool.tensor).float()
    out = [logits[starts[id(s)]:starts[id(s)] + s.num_new_tokens] for s in seqs]
    for s in seqs:
        s.request.num_computed_tokens += s.num_new_tokens
    return out


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()

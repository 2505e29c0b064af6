"""SchedulerConfig.final_chunk_alone: a step that carries a prompt's last prefill chunk takes no
other prefill chunk (neither a new admission nor another running prompt's), decodes still join;
off (the default) the rest of the budget is filled as before. Outputs do not change."""
from __future__ import annotations

import random

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BS = 4


def make(alone: bool, budget: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, final_chunk_alone=alone),
                     CacheConfig(block_size=BS), 64, 256)


def req(rid: str, n: int, max_tokens: int = 1, first: int = 3) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens))


def step(s: Scheduler) -> list[tuple[str, int]]:
    out = s.schedule()
    for r in s.update_from_output(out, {q.request.request_id: [7] for q in out.seqs if q.sample}):
        if r.num_output_tokens >= r.sampling_params.max_tokens:
            s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    s.check_integrity()
    return [(q.request.request_id, q.num_new_tokens) for q in out.seqs]


@pytest.mark.parametrize("alone, steps", [
    (False, [[("a", 5), ("b", 6)]]),
    (True, [[("a", 5)], [("b", 6)]]),
])
def test_two_short_prompts_share_a_step_only_without_the_option(alone, steps):
    s = make(alone)
    s.add_request(req("a", 5))
    s.add_request(req("b", 6, first=40))
    assert [step(s), *[step(s) for _ in steps[1:]]] == steps
    assert not s.has_unfinished()


@pytest.mark.parametrize("alone, third, fourth", [
    (False, [("d", 1), ("a", 5), ("b", 6)], [("d", 1)]),
    (True, [("d", 1), ("a", 5)], [("d", 1), ("b", 6)]),
])
def test_a_finishing_chunk_keeps_the_decodes_and_holds_back_the_next_prompt(alone, third, fourth):
    s = make(alone)
    s.add_request(req("d", 4, max_tokens=8))
    assert step(s) == [("d", 4)]
    s.add_request(req("a", 20, first=40))
    s.add_request(req("b", 6, first=80))
    assert step(s) == [("d", 1), ("a", 15)]          # a's first chunk fills the budget either way
    assert step(s) == third
    assert step(s) == fourth


@pytest.mark.parametrize("alone, steps", [
    (False, [[("p", 4), ("c", 4)]]),
    (True, [[("p", 4)], [("c", 4)]]),
])
def test_another_running_prompts_last_chunk_waits_for_the_next_step(alone, steps):
    s = make(alone)
    s.add_request(req("p", 20))
    assert step(s) == [("p", 16)]
    s.fork_request("p", req("c", 20))                # running, 16 tokens shared: its last 4 to compute
    assert [step(s), *[step(s) for _ in steps[1:]]] == steps


def test_random_traffic_drains_and_every_step_finishes_one_prompt_at_most():
    rng = random.Random(7)
    s, n, done = make(True, budget=24), 0, 0
    for _ in range(400):
        if n < 40 and rng.random() < 0.6:
            s.add_request(req(f"r{n}", rng.randrange(1, 50), max_tokens=rng.randrange(1, 5), first=rng.randrange(3, 9)))
            n += 1
        out = s.schedule()
        prompts = [q for q in out.seqs if q.num_new_tokens > 1 or not q.request.output_token_ids]
        assert len(prompts) <= 1 or not any(q.sample for q in prompts[:-1])
        assert sum(q.sample for q in prompts) <= 1
        for r in s.update_from_output(out, {q.request.request_id: [7] for q in out.seqs if q.sample}):
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
                done += 1
        s.check_integrity()
        if n == 40 and not s.has_unfinished():
            return
    raise AssertionError(f"the queue did not drain ({done} of {n} done)")


# ---- the engine on a tiny model, against transformers ---------------------------

def test_engine_output_is_unchanged_and_first_tokens_come_in_separate_steps(tiny_llama_dir, tiny_llama_hf):
    from tiny_models import hf_greedy
    rng = random.Random(4)
    prompts = {f"p{i}": [rng.randrange(3, 200) for _ in range(rng.randrange(5, 40))] for i in range(5)}
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outputs, first_steps = {}, {}
    for alone in (False, True):
        e = LLMEngine(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                                   scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48,
                                                             max_model_len=256, final_chunk_alone=alone)))
        for rid, p in prompts.items():
            e.add_request(rid, p, params)
        tokens: dict[str, list[int]] = {}
        firsts: list[int] = []
        while e.has_unfinished():
            outs = [d for d in e.step() if d.new_token_ids]
            firsts.append(sum(d.request_id not in tokens for d in outs))
            for d in outs:
                tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            e.check_integrity()
        outputs[alone], first_steps[alone] = tokens, firsts
    for rid, p in prompts.items():
        expected = hf_greedy(tiny_llama_hf, p, 5)
        assert outputs[False][rid] == expected and outputs[True][rid] == expected
    assert max(first_steps[False]) > 1 and max(first_steps[True]) == 1

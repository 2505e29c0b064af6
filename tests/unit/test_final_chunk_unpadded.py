"""SchedulerConfig.final_chunk_unpadded: a step that carries a prompt's last prefill chunk takes no
chunk that would not finish its prompt in it (a newcomer's first chunk); whole prompts and decodes
still join; off (the default) the rest of the budget is filled as before. Outputs do not change."""
from __future__ import annotations

import argparse
import random

import pytest

from cluster.cli import serve as serve_cli
from cluster.orchestration.launcher import engine_config
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

from _scheduler_helpers import step

BS = 4


def make(on: bool, budget: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, final_chunk_unpadded=on),
                     CacheConfig(block_size=BS), 64, 256)


def req(rid: str, n: int, max_tokens: int = 1, first: int = 3) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize("on, steps", [
    (False, [[("a", 5), ("b", 11)], [("b", 9)]]),
    (True, [[("a", 5)], [("b", 16)], [("b", 4)]]),
])
def test_a_newcomers_first_chunk_waits_for_the_next_step_only_with_the_option(on, steps):
    s = make(on)
    s.add_request(req("a", 5))
    s.add_request(req("b", 20, first=40))
    assert [step(s) for _ in steps] == steps
    assert not s.has_unfinished()


@pytest.mark.parametrize("on", [False, True])
def test_whole_prompts_that_finish_in_the_step_still_share_it(on):
    s = make(on)
    s.add_request(req("a", 5))
    s.add_request(req("b", 6, first=40))
    s.add_request(req("c", 5, first=80))
    assert step(s) == [("a", 5), ("b", 6), ("c", 5)]


@pytest.mark.parametrize("on, third, fourth", [
    (False, [("d", 1), ("a", 5), ("b", 10)], [("d", 1), ("b", 2)]),
    (True, [("d", 1), ("a", 5)], [("d", 1), ("b", 12)]),
])
def test_a_finishing_chunk_keeps_the_decodes_and_holds_back_a_partial_chunk(on, third, fourth):
    s = make(on)
    s.add_request(req("d", 4, max_tokens=8))
    assert step(s) == [("d", 4)]
    s.add_request(req("a", 20, first=40))
    s.add_request(req("b", 12, first=80))
    assert step(s) == [("d", 1), ("a", 15)]          # a's first chunk fills the budget either way
    assert step(s) == third
    assert step(s) == fourth


@pytest.mark.parametrize("on, steps", [
    (False, [[("p", 12), ("c", 4)], [("c", 8)]]),
    (True, [[("p", 12)], [("c", 12)]]),
])
def test_another_running_prompts_partial_chunk_waits_for_the_next_step(on, steps):
    s = make(on)
    s.add_request(req("p", 28))
    assert step(s) == [("p", 16)]
    s.fork_request("p", req("c", 28))                # running, 16 tokens shared: 12 left to compute
    assert [step(s) for _ in steps] == steps


def test_random_traffic_drains_and_no_partial_chunk_follows_a_final_one():
    rng = random.Random(7)
    s, n, done, held_back = make(True, budget=24), 0, 0, 0
    for _ in range(400):
        if n < 40 and rng.random() < 0.6:
            s.add_request(req(f"r{n}", rng.randrange(1, 50), max_tokens=rng.randrange(1, 5), first=rng.randrange(3, 9)))
            n += 1
        out = s.schedule()
        prompts = [q for q in out.seqs if q.num_new_tokens > 1 or not q.request.output_token_ids]
        finals = [i for i, q in enumerate(prompts) if q.sample]
        assert not finals or all(q.sample for q in prompts[finals[0]:])
        held_back += bool(finals) and out.num_tokens < 24 and s.num_waiting > 0
        for r in s.update_from_output(out, {q.request.request_id: [7] for q in out.seqs if q.sample}):
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
                done += 1
        s.check_integrity()
        if n == 40 and not s.has_unfinished():
            assert held_back > 0                     # the rule was exercised
            return
    raise AssertionError(f"the queue did not drain ({done} of {n} done)")


# ---- the engine on a tiny model, against transformers ---------------------------

def test_engine_output_is_unchanged_and_a_newcomer_waits_for_the_next_step(tiny_llama_dir, tiny_llama_hf):
    from tiny_models import hf_greedy
    rng = random.Random(4)
    prompts = {f"p{i}": [rng.randrange(3, 200) for _ in range(n)] for i, n in enumerate((60, 40, 9, 70))}
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outputs, shapes = {}, {}
    for on in (False, True):
        e = LLMEngine(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                                   scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48,
                                                             max_model_len=256, final_chunk_unpadded=on)))
        for rid, p in prompts.items():
            e.add_request(rid, p, params)
        schedule, steps = e.scheduler.schedule, []

        def recording_schedule(schedule=schedule, steps=steps):
            out = schedule()
            steps.append([(q.request.request_id, q.num_new_tokens) for q in out.seqs])
            return out

        e.scheduler.schedule = recording_schedule       # type: ignore[method-assign]
        tokens: dict[str, list[int]] = {}
        while e.has_unfinished():
            for d in e.step():
                tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            e.check_integrity()
        outputs[on], shapes[on] = tokens, steps
    for rid, p in prompts.items():
        expected = hf_greedy(tiny_llama_hf, p, 5)
        assert outputs[False][rid] == expected and outputs[True][rid] == expected
    assert shapes[False][1] == [("p0", 12), ("p1", 36)]
    assert shapes[True][1] == [("p0", 12)] and shapes[True][2] == [("p0", 1), ("p1", 40)]


def test_serve_flag_reaches_every_pools_scheduler():
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    for argv, want in (([], False), (["--final-chunk-unpadded"], True)):
        cfg = serve_cli.config_from_args(parser.parse_args(["serve", *argv]))
        assert [engine_config(cfg, pool).scheduler.final_chunk_unpadded
                for pool in ("prefill", "decode", "colocated")] == [want] * 3

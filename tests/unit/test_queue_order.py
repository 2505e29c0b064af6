"""Waiting-queue order (engine/queue_order.py): fcfs by default; fewest_uncached admits the
request with the fewest prompt tokens not in the prefix cache first, and a request that has
waited queue_max_pass_s goes in arrival order ahead of the rest."""
from __future__ import annotations

import random
from collections import deque

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.queue_order import FewestUncachedFirst
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

from _scheduler_helpers import step

BS = 4
PREFIX = list(range(100, 116))           # 4 full blocks


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(order: str, clock: Clock, budget: int = 8, max_pass_s: float = 20.0) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, queue_order=order,
                                     queue_max_pass_s=max_pass_s),
                     CacheConfig(block_size=BS), 64, 256, clock=clock)


def req(rid: str, tokens, max_tokens: int = 1) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def warmed(order: str, clock: Clock, **kw) -> Scheduler:
    """A scheduler whose prefix cache holds PREFIX (a finished request computed it)."""
    s = make(order, clock, **kw)
    s.add_request(req("warm", PREFIX + [1]))
    while s.has_unfinished():
        step(s)
    return s


def queue_cold_then_cached(s: Scheduler) -> None:
    s.add_request(req("cold", range(200, 224)))          # 24 tokens, none cached
    s.add_request(req("cached", PREFIX + [2, 3]))         # 18 tokens, 16 cached: 2 to compute


def test_fcfs_is_the_default_and_admits_the_cold_request_first():
    assert SchedulerConfig().queue_order == "fcfs"
    s = warmed("fcfs", Clock())
    queue_cold_then_cached(s)
    assert step(s) == [("cold", 8)]


def test_fewest_uncached_admits_the_cached_request_first_and_then_the_cold_one():
    s = warmed("fewest_uncached", Clock())
    queue_cold_then_cached(s)
    assert step(s) == [("cached", 2), ("cold", 6)]
    assert step(s) == [("cold", 8)]
    assert s.get_request("cached") is None                  # done after its first token


@pytest.mark.parametrize("now, first_step", [(19.0, [("cached", 2), ("cold", 6)]), (20.0, [("cold", 8)])])
def test_a_request_passed_over_for_max_pass_s_goes_first(now, first_step):
    clock = Clock()
    s = warmed("fewest_uncached", clock, max_pass_s=20.0)
    s.add_request(req("hog", range(300, 324)))           # 3 steps of the whole budget
    assert step(s) == [("hog", 8)]
    s.add_request(req("cold", range(200, 224)))
    assert step(s) == [("hog", 8)]                        # the scheduler sees cold waiting at 0
    s.add_request(req("cached", PREFIX + [2, 3]))
    assert step(s) == [("hog", 8)]
    clock.now = now
    assert step(s) == first_step                          # at 20 s cold goes ahead of the shorter one


def test_arrange_puts_preempted_then_starving_oldest_first_then_fewest_uncached():
    names = ["short", "old", "preempted", "long", "older", "tie_a", "tie_b"]
    reqs = {n: req(n, range(4)) for n in names}
    reqs["preempted"].status = RequestStatus.PREEMPTED
    uncached = {"short": 3, "old": 50, "preempted": 90, "long": 80, "older": 70, "tie_a": 10, "tie_b": 10}
    order = FewestUncachedFirst(20.0)
    arrange = lambda names, t: order.arrange(q := deque(reqs[n] for n in names),   # noqa: E731
                                             lambda r: uncached[r.request_id], lambda: t) or q
    arrange(["older"], 0.0)                          # queued since 0
    arrange(["older", "old"], 9.0)                   # since 9; the others appear at 30
    waiting = arrange(names, 30.0)
    assert [r.request_id for r in waiting] == ["preempted", "older", "old", "short", "tie_a", "tie_b", "long"]
    waiting = arrange(["long", "tie_a"], 31.0)       # the others left: forgotten, and the order holds
    assert [r.request_id for r in waiting] == ["tie_a", "long"] and set(order._since) == {"long", "tie_a"}


@pytest.mark.parametrize("kwargs, match", [
    ({"queue_order": "sjf"}, "queue_order must be one of fcfs, fewest_uncached"),
    ({"queue_order": "fewest_uncached", "queue_max_pass_s": 0.0}, "queue_max_pass_s must be > 0"),
])
def test_bad_queue_settings_say_how_to_fix_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)
    from cluster.config import ServeConfig
    with pytest.raises(ValueError, match=match):
        ServeConfig(**kwargs)


def test_random_shared_prefixes_always_drain_and_every_prompt_is_computed_once_at_most():
    rng, clock = random.Random(5), Clock()
    s = make("fewest_uncached", clock, budget=12, max_pass_s=3.0)
    heads = [[rng.randrange(3, 90) for _ in range(12)] for _ in range(3)]
    n = 0
    for t in range(300):
        clock.now = float(t)
        if n < 40 and rng.random() < 0.5:
            s.add_request(req(f"r{n}", rng.choice(heads) + [rng.randrange(3, 90) for _ in range(rng.randrange(1, 20))],
                              max_tokens=rng.randrange(1, 4)))
            n += 1
        step(s)
        if n == 40 and not s.has_unfinished():
            return
    raise AssertionError("the queue did not drain")


# ---- the engine on a tiny model, against transformers ---------------------------

def test_engine_output_is_unchanged_by_the_queue_order(tiny_llama_dir, tiny_llama_hf):
    from tiny_models import hf_greedy
    rng = random.Random(3)
    shared = [rng.randrange(3, 200) for _ in range(64)]
    warm, cold = shared + [5], [rng.randrange(3, 200) for _ in range(90)]
    cached = shared + [rng.randrange(3, 200) for _ in range(7)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outputs, first = {}, {}
    for order in ("fcfs", "fewest_uncached"):
        e = LLMEngine(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=16, num_blocks=64),
                                   scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                                             max_model_len=256, queue_order=order)))
        e.add_request("warm", warm, params)
        tokens: dict[str, list[int]] = {}
        order_seen: list[str] = []
        while e.has_unfinished():
            if "warm" in tokens and "cold" not in order_seen:
                e.add_request("cold", cold, params)
                e.add_request("cached", cached, params)
                order_seen += ["cold", "cached"]
            for d in e.step():
                if d.request_id not in tokens and d.new_token_ids:
                    first.setdefault(order, []).append(d.request_id)
                tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            e.check_integrity()
        outputs[order] = tokens
    for rid, prompt in (("warm", warm), ("cold", cold), ("cached", cached)):
        expected = hf_greedy(tiny_llama_hf, prompt, 5)
        assert outputs["fcfs"][rid] == expected and outputs["fewest_uncached"][rid] == expected
    assert first["fcfs"] == ["warm", "cold", "cached"]
    assert first["fewest_uncached"] == ["warm", "cached", "cold"]

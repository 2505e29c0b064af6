"""Waiting for an in-flight prefix (engine/prefix_wait.py): a request whose next
prompt blocks another running request is prefilling right now waits for them and
takes them as prefix hits instead of recomputing them."""
from __future__ import annotations

import random

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput

BS = 4


def make(num_blocks=64, budget=8, max_seqs=16, caching=True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                     CacheConfig(block_size=BS, enable_prefix_caching=caching), num_blocks, 256)


def req(rid, tokens, max_tokens=2, t=0.0) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), arrival_time=t)


def run(s: Scheduler, computed: dict[str, int], max_steps=500) -> int:
    """Step until done (fake sampler: token 7, finish at max_tokens); adds each
    request's computed prompt tokens to ``computed``. Returns the steps taken."""
    for n in range(max_steps):
        if not s.has_unfinished():
            return n
        out = s.schedule()
        for q in out.seqs:
            r = q.request
            if r.num_computed_tokens < r.num_prompt_tokens:
                computed[r.request_id] = computed.get(r.request_id, 0) + q.num_new_tokens
        for r in s.update_from_output(out, {q.request.request_id: [7] for q in out.seqs if q.sample}):
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
        s.check_integrity()
    raise AssertionError(f"not done after {max_steps} steps: a deadlock")


PREFIX = list(range(100, 124))           # 6 full blocks


def test_a_follower_admitted_in_the_owners_step_waits_and_computes_only_its_suffix():
    s = make(budget=64)
    s.add_request(req("owner", PREFIX + [1, 2, 3], t=0))
    s.add_request(req("follower", PREFIX + [4, 5], t=1))
    out = s.schedule()                   # both arrive before the first step: only the owner starts
    assert [q.request.request_id for q in out.seqs] == ["owner"]
    assert s.num_waiting == 1 and s.prefix_waits.stats.waits == 1 and s.prefix_waits.num_deferred == 1
    s.update_from_output(out, {"owner": [7]})
    computed: dict[str, int] = {}
    run(s, computed)
    assert computed["follower"] == 2                 # the 24 prefix tokens were hits
    assert s.get_request("follower") is None
    assert s.prefix_waits.stats.waits == 1 and s.prefix_waits.stats.blocks_saved == 6
    assert s.kv.prefix_cache_stats.hit_tokens == 24


def test_a_follower_waits_for_the_owners_last_prefill_chunk():
    s = make(budget=16)
    s.add_request(req("owner", PREFIX + [1, 2, 3], t=0))
    out = s.schedule()                               # the owner's first chunk: 16 tokens, 4 blocks
    s.update_from_output(out, {})
    s.add_request(req("follower", PREFIX + [4, 5], t=1))
    out = s.schedule()                               # owner: 11 more; blocks 4 and 5 are in flight
    assert [(q.request.request_id, q.num_new_tokens) for q in out.seqs] == [("owner", 11)]
    assert s.prefix_waits.num_deferred == 1
    s.update_from_output(out, {"owner": [7]})
    computed: dict[str, int] = {}
    run(s, computed)
    assert computed["follower"] == 2                 # not 26 - 16 = 10: blocks 4 and 5 were waited for
    assert s.prefix_waits.stats.blocks_saved == 2


def test_a_follower_with_a_shorter_shared_part_waits_only_for_that_part():
    s = make(budget=64)
    s.add_request(req("owner", PREFIX + [1, 2, 3], t=0))
    s.add_request(req("follower", PREFIX[:8] + list(range(300, 310)), t=1))
    s.add_request(req("stranger", list(range(500, 510)), t=2))
    out = s.schedule()                               # the follower waits, the stranger behind it does not
    assert [q.request.request_id for q in out.seqs] == ["owner", "stranger"]
    s.update_from_output(out, {"owner": [7], "stranger": [7]})
    computed: dict[str, int] = {}
    run(s, computed)
    assert computed["follower"] == 10 and s.prefix_waits.stats.blocks_saved == 2


def test_without_prefix_caching_nobody_waits():
    s = make(budget=64, caching=False)
    s.add_request(req("owner", PREFIX + [1], t=0))
    s.add_request(req("follower", PREFIX + [2], t=1))
    computed: dict[str, int] = {}
    run(s, computed)
    assert computed == {"owner": 25, "follower": 25} and s.prefix_waits.stats.waits == 0


def test_an_owner_aborted_during_its_last_chunk_lets_the_follower_compute_the_rest():
    s = make(budget=16)
    s.add_request(req("owner", PREFIX + [1], t=0))
    s.update_from_output(s.schedule(), {})           # 16 tokens computed, 4 blocks cached
    s.add_request(req("follower", PREFIX + [2], t=1))
    out = s.schedule()                               # the owner's last chunk; the follower waits
    assert s.prefix_waits.num_deferred == 1
    assert s.abort_request("owner")                  # aborted while that chunk runs
    s.update_from_output(out, {"owner": [7]})
    s.check_integrity()
    computed: dict[str, int] = {}
    run(s, computed)
    assert computed["follower"] == 25 - 16           # it computes what the owner never cached
    assert s.prefix_waits.stats == type(s.prefix_waits.stats)(waits=1, blocks_saved=0)


def test_many_followers_no_deadlock_and_the_prefix_is_computed_once():
    s = make(budget=64, max_seqs=4, num_blocks=80)
    s.add_request(req("owner", PREFIX + [1], t=0))
    for i in range(12):
        s.add_request(req(f"f{i}", PREFIX + [200 + i, 201 + i], t=1 + i))
    computed: dict[str, int] = {}
    run(s, computed)
    assert computed["owner"] == 25
    assert all(computed[f"f{i}"] == 2 for i in range(12))
    assert s.prefix_waits.stats.waits == 12 and s.prefix_waits.stats.blocks_saved == 12 * 6


def test_a_preempted_owner_stops_holding_its_followers():
    s = make(budget=16)
    s.add_request(req("owner", PREFIX + [1], t=0))
    s.add_request(req("follower", PREFIX + [2], t=1))
    s.update_from_output(s.schedule(), {})           # owner: 16 tokens, 4 blocks cached
    out = s.schedule()                               # owner's last chunk; the follower waits for it
    assert s.prefix_waits.num_deferred == 1
    s._preempt(s.get_request("owner"), SchedulerOutput())  # as the pool would when it runs out
    s.update_from_output(out, {"owner": [7]})        # the preempted owner's chunk is dropped
    s.check_integrity()
    assert s.prefix_waits.pending(s.running) == {}
    computed: dict[str, int] = {}
    run(s, computed)
    assert computed["owner"] == 9 and computed["follower"] == 1     # owner again first (its 4 blocks hit)
    assert not s.has_unfinished() and s.prefix_waits.num_deferred == 0


def test_random_arrivals_and_aborts_of_shared_prefixes_always_drain():
    rng = random.Random(5)
    s = make(budget=24, max_seqs=6, num_blocks=24)      # tight: preemptions happen
    prefixes = [list(range(k * 100, k * 100 + 20)) for k in range(3)]
    computed: dict[str, int] = {}
    n = 0
    for step in range(300):
        while n < 60 and rng.random() < 0.5:
            p = rng.choice(prefixes)
            s.add_request(req(f"r{n}", p[:rng.randrange(4, 21)] + [rng.randrange(1, 90)],
                              max_tokens=rng.randrange(1, 30), t=step))
            n += 1
        if rng.random() < 0.05 and s.queues.live_ids():
            s.abort_request(rng.choice(s.queues.live_ids()))
        out = s.schedule()
        for r in s.update_from_output(out, {q.request.request_id: [7] for q in out.seqs if q.sample}):
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
        s.check_integrity()
    run(s, computed)
    assert s.prefix_waits.num_deferred == 0 and s.prefix_waits.stats.waits > 0
    assert s.num_recompute_preemptions + s.num_swap_preemptions > 0


# ---- the engine on a tiny model, against transformers ---------------------------

def _engine(model_dir, budget=64) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), cache=CacheConfig(block_size=16, num_blocks=96),
                                  scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                                            max_model_len=512)))


def _drive(engine: LLMEngine, abort_after: tuple[str, int] | None = None) -> tuple[dict, dict]:
    """Run to the end; returns (output tokens, prompt tokens computed) per request."""
    tokens: dict[str, list[int]] = {}
    prefilled: dict[str, int] = {}
    schedule = engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        for q in out.seqs:
            r = q.request
            if r.num_computed_tokens < r.num_prompt_tokens:
                prefilled[r.request_id] = prefilled.get(r.request_id, 0) + q.num_new_tokens
        return out

    engine.scheduler.schedule = counting_schedule     # type: ignore[method-assign]
    steps = 0
    while engine.has_unfinished():
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
        steps += 1
        if abort_after and steps == abort_after[1]:
            engine.abort_request(abort_after[0])
        engine.check_integrity()
        assert steps < 400, "engine did not drain"
    return tokens, prefilled


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from tiny_models import load_hf_model
    return load_hf_model(tiny_llama_dir)


def _prompts(vocab=200):
    rng = random.Random(11)
    shared = [rng.randrange(3, vocab) for _ in range(96)]          # 6 blocks of 16
    return shared + [rng.randrange(3, vocab) for _ in range(9)], shared + [rng.randrange(3, vocab) for _ in range(5)]


def test_engine_follower_computes_only_its_suffix_and_matches_transformers(tiny_llama_dir, hf):
    from tiny_models import hf_greedy
    a, b = _prompts()
    e = _engine(tiny_llama_dir)
    e.add_request("a", a, GREEDY)
    e.add_request("b", b, GREEDY)
    tokens, prefilled = _drive(e)
    assert prefilled == {"a": len(a), "b": len(b) - 96}
    assert tokens["a"] == hf_greedy(hf, a, 6) and tokens["b"] == hf_greedy(hf, b, 6)
    alone = _engine(tiny_llama_dir)
    alone.add_request("b", b, GREEDY)
    assert _drive(alone)[0]["b"] == tokens["b"]
    stats = e.stats()
    assert stats.prefix_waits == 1 and stats.prefix_wait_blocks_saved == 2     # blocks 4 and 5


@pytest.mark.parametrize("abort_after_steps, a_prefilled, b_prefilled", [
    (1, 64, 101 - 64),     # mid-prefill, before b was looked at: b computes what a never cached
    (2, 105, 5),           # a's last chunk ran while b waited; a is aborted before its first decode
])
def test_engine_owner_aborted_follower_still_matches_transformers(tiny_llama_dir, hf, abort_after_steps,
                                                                 a_prefilled, b_prefilled):
    from tiny_models import hf_greedy
    a, b = _prompts()
    e = _engine(tiny_llama_dir)
    e.add_request("a", a, GREEDY)
    e.add_request("b", b, GREEDY)
    tokens, prefilled = _drive(e, abort_after=("a", abort_after_steps))
    assert prefilled == {"a": a_prefilled, "b": b_prefilled}
    assert tokens["b"] == hf_greedy(hf, b, 6)


def test_worker_series_export_the_prefix_wait_counters():
    from cluster.observability.metrics_workers import WorkerSeries, WorkerStats
    series = WorkerSeries()
    series.observe(WorkerStats("p0", "prefill", 0, 0, 1, 8, 100, 40, prefix_waits=3, prefix_wait_blocks_saved=12))
    got = {(s.name, s.labels["worker"]): s.value for m in series.collect() for s in m.samples}
    assert got[("pdserve_prefix_waits_total", "p0")] == 3
    assert got[("pdserve_prefix_wait_blocks_saved_total", "p0")] == 12

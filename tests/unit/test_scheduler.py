"""Scheduler: budgets, chunked prefill, prefix hits, preemption, holds, forks, remote KV."""
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BS = 4


def make(num_blocks=16, budget=64, max_seqs=8, chunked=True, max_model_len=128, caching=True, clock=None):
    kwargs = {"clock": clock} if clock else {}
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     enable_chunked_prefill=chunked),
                     CacheConfig(block_size=BS, enable_prefix_caching=caching),
                     num_blocks, max_model_len, **kwargs)


def req(rid, tokens, max_tokens=8, t=0.0, **kw):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), arrival_time=t, **kw)


def plan(out):
    return [(s.request.request_id, s.num_new_tokens, s.sample) for s in out.seqs]


def step(s, token=7):
    """schedule -> fake sampler -> update; returns the output."""
    out = s.schedule()
    s.update_from_output(out, {q.request.request_id: [token] for q in out.seqs if q.sample})
    s.check_integrity()
    return out


# ---- admission ------------------------------------------------------------------

def test_add_request_validates_length_and_sets_max_total_tokens():
    s = make(max_model_len=20)
    with pytest.raises(ValueError, match="shorten the prompt or lower max_tokens"):
        s.add_request(req("a", range(15), max_tokens=6))
    r = req("b", range(15), max_tokens=5)
    s.add_request(r)
    assert r.max_total_tokens == 20 and r.status == RequestStatus.WAITING
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("b", range(3)))
    with pytest.raises(ValueError, match="KV blocks but the pool has 2"):
        make(num_blocks=2).add_request(req("c", range(8), max_tokens=1))
    with pytest.raises(ValueError, match="enable chunked prefill"):
        make(budget=8, chunked=False).add_request(req("d", range(8), max_tokens=1))


def test_prefill_then_decode():
    s = make()
    s.add_request(req("a", range(5), t=0))
    s.add_request(req("b", range(100, 103), t=1))
    out = step(s, token=9)
    assert plan(out) == [("a", 5, True), ("b", 3, True)]
    assert out.seqs[0].block_ids == [0, 1] and out.seqs[1].block_ids == [2]
    a = s.get_request("a")
    assert a.output_token_ids == [9] and a.num_computed_tokens == 5 and a.num_cached_tokens == 0
    out = step(s)
    assert plan(out) == [("a", 1, True), ("b", 1, True)]
    assert out.seqs[1].block_ids == [2]             # b's 4th token still fits its first block
    assert plan(step(s)) == [("a", 1, True), ("b", 1, True)]
    assert s.kv.get_block_ids("b") == [2, 3]        # its 5th token needs a second one
    assert s.num_running == 2 and s.num_waiting == 0 and s.has_unfinished()


def test_chunked_prefill_chunk_sizes_and_budget_sharing():
    s = make(budget=8)
    s.add_request(req("long", range(20), t=0))
    s.add_request(req("short", range(100, 103), t=1))
    assert plan(step(s)) == [("long", 8, False)]
    assert s.num_waiting_tokens == 12 + 3
    assert plan(step(s)) == [("long", 8, False)]
    assert plan(step(s)) == [("long", 4, True), ("short", 3, True)]
    assert plan(step(s)) == [("long", 1, True), ("short", 1, True)]
    assert s.num_waiting_tokens == 0


def test_decodes_first_then_a_chunk_of_the_waiting_prompt():
    s = make(budget=6)
    s.add_request(req("a", range(3), t=0))
    step(s)
    s.add_request(req("b", range(100, 110), t=1))
    assert plan(step(s)) == [("a", 1, True), ("b", 5, False)]


def test_chunking_disabled_waits_for_a_whole_prompt():
    s = make(budget=24, chunked=False)
    s.add_request(req("a", range(3), max_tokens=4, t=0))
    s.add_request(req("b", range(100, 122), max_tokens=2, t=1))
    assert plan(step(s)) == [("a", 3, True)]        # b (22) does not fit in the 21 left
    assert plan(step(s)) == [("a", 1, True), ("b", 22, True)]


def test_max_num_seqs():
    s = make(max_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", range(10 * i, 10 * i + 2), t=i))
    assert [p[0] for p in plan(step(s))] == ["r0", "r1"]
    assert s.num_waiting == 1


def test_prefix_hit_records_num_cached_tokens_and_schedules_the_rest():
    s = make()
    s.add_request(req("a", range(10), t=0))
    step(s)
    s.add_request(req("b", list(range(9)) + [99, 98], t=1))
    out = step(s)
    assert plan(out) == [("a", 1, True), ("b", 3, True)]
    b = s.get_request("b")
    assert b.num_cached_tokens == 8 and out.seqs[1].block_ids[:2] == out.seqs[0].block_ids[:2]
    assert s.kv.prefix_cache_stats.hit_tokens == 8


# ---- preemption ---------------------------------------------------------------

def test_preempts_the_most_recent_arrival_by_recompute():
    s = make(num_blocks=4)
    s.add_request(req("old", range(7), t=0))            # blocks 0 1
    s.add_request(req("new", range(100, 107), t=1))     # blocks 2 3
    step(s, token=5)                                    # both at 8 tokens, 7 computed
    step(s, token=6)                                    # both at 9 tokens: need a 3rd block each
    out = s.schedule()
    assert out.preempted_ids == ["new"]
    assert plan(out) == [("old", 1, True)] and out.seqs[0].block_ids == [0, 1, 3]
    new = s.get_request("new")
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.output_token_ids == [5, 6] and new.num_preemptions == 1
    assert list(s.waiting) == [new] and s.kv.get_block_ids("new") == []
    s.update_from_output(out, {"old": [1]})
    s.check_integrity()
    s.finish_request("old", RequestStatus.FINISHED_STOPPED)
    out = step(s)
    # recompute prompt + outputs (9 tokens); its first full block is still cached
    assert plan(out) == [("new", 5, True)] and new.status == RequestStatus.RUNNING
    assert new.num_cached_tokens == 0               # recorded on first scheduling only


def test_a_running_request_preempts_itself_when_it_is_the_latest():
    s = make(num_blocks=3)
    s.add_request(req("a", range(4), max_tokens=4, t=0))        # block 0, then 1 at the 5th token
    s.add_request(req("b", range(100, 104), max_tokens=4, t=1))  # block 2
    step(s)
    out = s.schedule()                               # both need a new block; 1 left: a gets it
    assert out.preempted_ids == ["b"] and plan(out) == [("a", 1, True)]


# ---- finishing, holding, aborting ---------------------------------------------

def test_finish_frees_blocks():
    s = make(num_blocks=8)
    s.add_request(req("a", range(9)))
    step(s)
    assert s.kv.num_free_blocks == 5
    assert s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert s.kv.num_free_blocks == 8 and not s.has_unfinished()
    assert not s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    with pytest.raises(ValueError, match="FINISHED_"):
        s.finish_request("a", RequestStatus.RUNNING)


def test_hold_kv_on_finish_releases_exactly_once():
    clock = iter([42.0]).__next__
    s = make(num_blocks=8, clock=clock)
    r = req("p", range(9), hold_kv_on_finish=True)
    s.add_request(r)
    ids = step(s).seqs[0].block_ids
    s.finish_request("p", RequestStatus.FINISHED_LENGTH)
    assert r.status == RequestStatus.FINISHED_LENGTH and s.num_held == 1 and s.held_since("p") == 42.0
    assert s.kv.get_block_ids("p") == ids and s.kv.num_free_blocks == 5
    s.check_integrity()
    assert s.release_held("p") is True
    assert s.kv.num_free_blocks == 8
    assert s.release_held("p") is False
    assert s.abort_request("p") is False
    s.check_integrity()


def test_abort_in_every_state():
    s = make(num_blocks=8, max_seqs=1)
    s.add_request(req("run", range(5), t=0))
    s.add_request(req("wait", range(5), t=1))
    step(s)
    s.add_request(req("held", range(5), t=2, hold_kv_on_finish=True))
    s.finish_request("run", RequestStatus.FINISHED_STOPPED)
    step(s)                                          # "wait" runs
    s.finish_request("wait", RequestStatus.FINISHED_STOPPED)
    step(s)                                          # "held" runs
    s.finish_request("held", RequestStatus.FINISHED_STOPPED)
    assert s.num_held == 1
    s.add_request(req("w2", range(5), t=3))
    s.add_request(req("w3", range(5), t=4))
    step(s)                                          # w2 running, w3 waiting
    alloc = s.add_remote_request(req("remote", range(200, 205), t=5))
    assert alloc is None                             # max_num_seqs = 1 is taken by w2
    for rid in ("held", "w2", "w3"):
        assert s.abort_request(rid) is True
        s.check_integrity()
    assert s.abort_request("nope") is False
    alloc = s.add_remote_request(req("remote", range(200, 205), t=5))
    assert alloc is not None and s.abort_request("remote") is True
    assert s.kv.num_free_blocks == 8 and not s.has_unfinished() and s.num_held == 0


def test_aborted_between_schedule_and_update_is_skipped():
    s = make()
    s.add_request(req("a", range(5)))
    out = s.schedule()
    s.abort_request("a")
    assert s.update_from_output(out, {"a": [1]}) == []
    s.check_integrity()


def test_missing_sampled_token_is_an_error():
    s = make()
    s.add_request(req("a", range(5)))
    out = s.schedule()
    with pytest.raises(ValueError, match="no token for it"):
        s.update_from_output(out, {})


# ---- n > 1 --------------------------------------------------------------------

def test_fork_shares_blocks_and_copies_on_write():
    s = make(num_blocks=8)
    s.add_request(req("p", range(6), t=0))
    step(s, token=1)                                 # p: 6 computed + token 1; blocks 0 1
    child = req("p#1", range(6), t=0.5)
    child.append_output_token(2)
    s.fork_request("p", child)
    assert s.kv.get_block_ids("p#1") == [0, 1] and child.status == RequestStatus.RUNNING
    assert child.num_computed_tokens == 6
    s.check_integrity()
    out = step(s)
    assert plan(out) == [("p", 1, True), ("p#1", 1, True)]
    assert out.block_copies == [(1, 2)]             # p writes into shared block 1 first
    assert out.seqs[0].block_ids == [0, 2] and out.seqs[1].block_ids == [0, 1]


def test_fork_before_prefill_just_queues_the_child():
    s = make()
    s.add_request(req("p", range(6)))
    s.fork_request("p", req("p#1", range(6)))
    assert s.num_waiting == 2
    with pytest.raises(ValueError, match="same prompt"):
        s.fork_request("p", req("p#2", range(5)))


# ---- remote KV (decode role) --------------------------------------------------

def test_remote_kv_flow_pulls_only_uncached_blocks():
    s = make(num_blocks=8)
    s.add_request(req("local", range(9), t=0))
    step(s)                                          # caches blocks 0, 1
    r = req("r", list(range(8)) + [50, 51, 52], t=1)
    alloc = s.add_remote_request(r)
    assert alloc.block_ids == (0, 1, 3) and alloc.num_cached_tokens == 8 and alloc.num_cached_blocks == 2
    assert alloc.blocks_to_pull == (3,)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KV and s.num_remote == 1
    s.check_integrity()
    assert plan(step(s)) == [("local", 1, True)]     # remote requests are not scheduled
    s.remote_kv_ready("r", first_token=77)
    assert r.status == RequestStatus.RUNNING and r.output_token_ids == [77]
    assert r.num_computed_tokens == 11
    out = step(s)
    assert plan(out) == [("local", 1, True), ("r", 1, True)]
    assert out.seqs[1].block_ids == [0, 1, 3]
    with pytest.raises(ValueError, match="not waiting for remote KV"):
        s.remote_kv_ready("r", 1)


def test_remote_full_prompt_hit_needs_no_pull():
    s = make(num_blocks=8)
    s.add_request(req("local", range(9), t=0))
    step(s)
    alloc = s.add_remote_request(req("r", range(8), t=1))
    assert alloc.block_ids == (0, 1) and alloc.blocks_to_pull == ()


def test_remote_kv_failed_falls_back_to_local_prefill():
    s = make(num_blocks=8)
    s.add_request(req("other", range(100, 103), t=0))
    r = req("r", range(10), t=1)
    alloc = s.add_remote_request(r)
    assert alloc.blocks_to_pull == (0, 1, 2)
    s.remote_kv_failed("r")
    assert r.status == RequestStatus.WAITING and s.kv.num_free_blocks == 8
    assert list(s.waiting)[0] is r                   # ahead of other waiting requests
    s.check_integrity()
    assert plan(step(s)) == [("r", 10, True), ("other", 3, True)]
    assert s.kv.drain_events()[0].block_hashes == tuple(r.block_hashes)   # nothing bogus cached before


def test_remote_without_room_returns_none_and_changes_nothing():
    s = make(num_blocks=3)
    s.add_request(req("a", range(8), max_tokens=1, t=0))
    step(s)
    assert s.add_remote_request(req("r", range(100, 108), max_tokens=1, t=1)) is None
    assert s.get_request("r") is None and s.kv.num_free_blocks == 1
    s.check_integrity()


def test_kv_usage_and_integrity_of_a_corrupted_queue():
    s = make(num_blocks=4)
    s.add_request(req("a", range(5)))
    step(s)
    assert s.kv_usage == pytest.approx(0.5)
    s.get_request("a").status = RequestStatus.WAITING
    with pytest.raises(AssertionError, match="running a"):
        s.check_integrity()

"""Tiers: exact behaviour of page-outs, page-ins, swaps, events and integrity."""
import pytest

from engine.block_hash import block_hashes, packed_tokens, root_hash
from engine.block_manager import KVCacheManager
from engine.block_pool import BlockPool, IntegrityError
from engine.config import CacheConfig, SchedulerConfig
from engine.kv_events import KVEventKind, Tier
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.tiers.cost import PreemptionMode, PreemptionPolicy, ThroughputMeter, preemption_cost
from engine.tiers.storage import move_runs
from engine.tiers.types import KVMove, TierEntry, TierSizes

BS = 4
D, H, K = Tier.DEVICE, Tier.HOST, Tier.DISK


def cache_one(pool, tokens):
    """Cache one fresh block holding ``tokens``, free it; returns its hash."""
    [block] = pool.get_new_blocks(1)
    [h] = block_hashes(tokens, BS, None)
    pool.cache_full_blocks([block], [h], [packed_tokens(tokens)], root_hash(None))
    pool.free_blocks([block])
    return h


def req(rid, tokens, max_tokens=8):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


# ---- moving down ----------------------------------------------------------------------

def test_eviction_cascades_device_host_disk_then_drops():
    pool = BlockPool(1, tier_sizes=TierSizes(host_blocks=1, disk_blocks=1))
    a = cache_one(pool, [1, 2, 3, 4])
    pool.drain_events()
    b = cache_one(pool, [5, 6, 7, 8])             # evicts a: device -> host
    assert pool.lower.host.lookup(a) is not None
    c = cache_one(pool, [9, 9, 9, 9])             # evicts b to host, a host -> disk
    cache_one(pool, [7, 7, 7, 7])                 # evicts c to host, b to disk, a falls off
    assert pool.moves.take() == [KVMove(D, 0, H, 0),
                                 KVMove(H, 0, K, 0), KVMove(D, 0, H, 0),
                                 KVMove(H, 0, K, 0), KVMove(D, 0, H, 0)]
    kinds = [(e.kind, e.block_hashes, e.tier) for e in pool.drain_events()
             if e.kind is not KVEventKind.STORED or e.tier is not D]
    assert kinds == [(KVEventKind.STORED, (a,), H),
                     (KVEventKind.STORED, (a,), K), (KVEventKind.STORED, (b,), H),
                     (KVEventKind.REMOVED, (a,), K), (KVEventKind.STORED, (b,), K),
                     (KVEventKind.STORED, (c,), H)]
    snap = pool.snapshot()
    assert (snap.blocks[H], snap.blocks[K]) == ((c,), (b,))
    pool.check_integrity()


def test_host_lru_order_and_event_ids_stay_consecutive():
    pool = BlockPool(1, tier_sizes=TierSizes(host_blocks=3))
    hashes = [cache_one(pool, [i] * 4) for i in range(4)]    # the last one stays on device
    assert pool.lower.host.lru_hashes() == hashes[:3]
    ids = [e.event_id for e in pool.drain_events()]
    assert ids == list(range(1, len(ids) + 1))


def test_device_caching_a_hash_again_discards_the_lower_copy():
    pool = BlockPool(1, tier_sizes=TierSizes(host_blocks=2))
    a = cache_one(pool, [1, 2, 3, 4])
    cache_one(pool, [5, 6, 7, 8])                 # a -> host
    [block] = pool.get_new_blocks(1)             # b -> host too
    pool.cache_full_blocks([block], [a], [packed_tokens([1, 2, 3, 4])], root_hash(None))
    assert pool.lookup(a) is block and pool.lookup_lower(a) is None
    assert pool.lower.host.num_cached == 1
    pool.check_integrity()


def test_reset_clears_every_tier_but_keeps_swapped_blocks():
    kv = KVCacheManager(4, BS, tier_sizes=TierSizes(host_blocks=4))
    r = req("r", range(8))
    kv.allocate_slots(r, 8, kv.get_computed_blocks(r))
    r.num_computed_tokens = 8
    kv.cache_blocks(r, 8)
    assert kv.swap_out(r)
    s = req("s", range(100, 116))
    kv.allocate_slots(s, 16, kv.get_computed_blocks(s))   # evicts r's cached blocks to host
    assert kv.pool.lower.host.num_cached == 2
    kv.reset_prefix_cache()
    assert kv.pool.lower.host.num_cached == 0 and kv.pool.lower.host.num_pinned == 2
    kv.check_integrity()


# ---- moving up --------------------------------------------------------------------------

def test_prefix_hit_in_the_host_tier_pages_in_and_moves_the_block_up():
    kv = KVCacheManager(3, BS, tier_sizes=TierSizes(host_blocks=4))
    a = req("a", range(9))
    kv.allocate_slots(a, 9, kv.get_computed_blocks(a))
    a.num_computed_tokens = 9
    kv.cache_blocks(a, 9)
    kv.free(a)                                     # blocks 1, 0 cached; 2 private
    b = req("b", range(50, 62))
    kv.allocate_slots(b, 12, kv.get_computed_blocks(b))   # evicts 1 and 0 (LRU: tail first)
    assert kv.take_kv_moves() == [KVMove(D, 1, H, 0), KVMove(D, 0, H, 1)]
    kv.free(b)
    kv.pool.drain_events()
    c = req("c", list(range(9)) + [77])
    hit = kv.get_computed_blocks(c)
    assert hit.num_computed_tokens == 8 and [type(x) for x in hit.blocks] == [TierEntry, TierEntry]
    table = kv.allocate_slots(c, 2, hit)
    moves = kv.take_kv_moves()
    assert [(m.src_tier, m.src, m.dst_tier) for m in moves if m.src_tier is H] == [(H, 1, D), (H, 0, D)]
    assert [m.dst for m in moves if m.src_tier is H] == table[:2]
    [stored] = [e for e in kv.pool.drain_events() if e.tier is D]
    assert stored.kind is KVEventKind.STORED and stored.block_hashes == tuple(c.block_hashes[:2])
    assert kv.pool.lower.host.num_cached == 0 and kv.tier_counters.page_ins == 2
    assert kv.prefix_cache_stats.hit_tokens == 8
    kv.check_integrity()


def test_full_prompt_hit_in_host_keeps_the_lower_copy_of_the_block_it_rewrites():
    kv = KVCacheManager(2, BS, tier_sizes=TierSizes(host_blocks=4))
    a = req("a", range(8))
    kv.allocate_slots(a, 8, kv.get_computed_blocks(a))
    a.num_computed_tokens = 8
    kv.cache_blocks(a, 8)
    kv.free(a)
    b = req("b", range(20, 28))
    kv.allocate_slots(b, 8, kv.get_computed_blocks(b))
    kv.free(b)                                     # a's two blocks are on the host now
    c = req("c", range(8))
    hit = kv.get_computed_blocks(c)
    assert hit.num_computed_tokens == 7            # backs off one token: block 2 is rewritten
    kv.allocate_slots(c, 1, hit)
    assert kv.pool.lookup(c.block_hashes[0]) is not None
    assert kv.pool.lookup(c.block_hashes[1]) is None and kv.pool.lookup_lower(c.block_hashes[1]) is not None
    kv.check_integrity()


def test_page_in_claims_its_slot_before_its_own_evictions_need_room():
    kv = KVCacheManager(2, BS, tier_sizes=TierSizes(host_blocks=1))
    pool = kv.pool
    h = cache_one(pool, [0, 1, 2, 3])               # block 0
    o1 = cache_one(pool, [8, 8, 8, 8])              # block 1
    o2 = cache_one(pool, [9, 9, 9, 9])              # block 0 again: h -> host slot 0
    kv.take_kv_moves()
    c = req("c", [0, 1, 2, 3, 4])
    assert kv.allocate_slots(c, 1, kv.get_computed_blocks(c)) == [1, 0]
    # o1 is evicted while h's slot is claimed: no room, dropped; h is read from slot 0
    # before o2's page-out reuses it
    assert kv.take_kv_moves() == [KVMove(H, 0, D, 1), KVMove(D, 0, H, 0)]
    assert pool.lookup(h) is not None and pool.lookup(o1) is None and pool.lookup_lower(o1) is None
    assert pool.lookup_lower(o2).slot == 0
    kv.check_integrity()


# ---- swap ---------------------------------------------------------------------------------

def _scheduler(num_blocks, host, mode):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), CacheConfig(block_size=BS),
                     num_blocks, max_model_len=64, tier_sizes=TierSizes(host_blocks=host),
                     preemption=PreemptionPolicy(mode))


def _step(s, token=1):
    out = s.schedule()
    s.update_from_output(out, {q.request.request_id: [token] for q in out.seqs if q.sample})
    return out


def test_preemption_by_swap_resumes_without_recompute():
    s = _scheduler(5, host=8, mode="swap")
    a, b = req("a", range(6), 10), req("b", range(10, 16), 10)
    a.arrival_time, b.arrival_time = 1.0, 2.0
    s.add_request(a)
    s.add_request(b)
    _step(s)                                       # both prefill 6 tokens: 2 blocks each
    _step(s)                                       # decodes fit in the same blocks
    _step(s)
    out = _step(s)                                 # a takes the last free block; b preempts itself
    assert out.preempted_ids == ["b"] and s.num_swap_preemptions == 1
    assert [(m.src_tier, m.dst_tier) for m in out.kv_moves] == [(D, H), (D, H)]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    s.check_integrity()
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    [seq] = out.seqs
    assert seq.request is b and seq.num_new_tokens == 1     # resumes at its last token
    assert [(m.src_tier, m.dst_tier) for m in out.kv_moves if m.src_tier is H] == [(H, D), (H, D)]
    assert seq.block_ids[:2] == [m.dst for m in out.kv_moves if m.src_tier is H]
    assert s.kv.pool.lower.host.num_pinned == 0
    s.check_integrity()


def test_swap_without_host_room_falls_back_to_recompute():
    s = _scheduler(5, host=1, mode="swap")
    a, b = req("a", range(6), 10), req("b", range(10, 16), 10)
    b.arrival_time = a.arrival_time + 1
    s.add_request(a)
    s.add_request(b)
    for _ in range(4):
        out = _step(s)
    assert out.preempted_ids == ["b"]
    assert (s.num_swap_preemptions, s.num_recompute_preemptions) == (0, 1)
    s.check_integrity()


def test_abort_of_a_swapped_request_unpins_its_host_slots():
    s = _scheduler(5, host=8, mode="swap")
    a, b = req("a", range(6), 10), req("b", range(10, 16), 10)
    b.arrival_time = a.arrival_time + 1
    s.add_request(a)
    s.add_request(b)
    for _ in range(4):
        _step(s)
    assert s.kv.pool.lower.host.num_pinned == 2
    assert s.abort_request("b")
    assert s.kv.pool.lower.host.num_pinned == 0
    s.check_integrity()


# ---- the cost rule ------------------------------------------------------------------------

def test_cost_rule_compares_bytes_at_bandwidth_with_tokens_at_prefill_speed():
    cost = preemption_cost(num_blocks=10, bytes_per_block=1000, num_tokens=160, bandwidth=1e6,
                           prefill_tokens_per_s=1000)
    assert cost.swap_seconds == pytest.approx(0.02) and cost.recompute_seconds == pytest.approx(0.16)
    assert cost.prefers_swap
    slow = preemption_cost(10, 1000, 160, bandwidth=1e4, prefill_tokens_per_s=1000)
    assert not slow.prefers_swap
    assert not preemption_cost(10, 1000, 160, None, 1000).prefers_swap     # no host tier measured
    assert preemption_cost(10, 1000, 160, 1e6, None).prefers_swap


def test_policy_auto_uses_the_running_averages_and_config_overrides():
    bw, prefill = ThroughputMeter(alpha=0.5), ThroughputMeter(alpha=0.5)
    policy = PreemptionPolicy("auto", bytes_per_block=1000, bandwidth=bw, prefill=prefill)
    assert policy.choose(4, 64) is PreemptionMode.RECOMPUTE              # bandwidth unknown
    bw.observe(1e6, 1.0)
    prefill.observe(1000, 1.0)
    assert policy.choose(4, 64) is PreemptionMode.SWAP                   # 8 ms vs 64 ms
    bw.observe(1e3, 1.0)                                                 # EWMA: 500500, then 250750
    bw.observe(1e3, 1.0)
    assert bw.rate == pytest.approx(250750)
    assert policy.choose(40, 64) is PreemptionMode.RECOMPUTE             # 320 ms vs 64 ms
    assert PreemptionPolicy("swap").choose(40, 1) is PreemptionMode.SWAP
    assert PreemptionPolicy("recompute").choose(1, 10**6) is PreemptionMode.RECOMPUTE
    with pytest.raises(ValueError, match="auto, swap, recompute"):
        PreemptionPolicy("sometimes")


# ---- executor batching and integrity ---------------------------------------------------------

def test_move_runs_batch_same_tiers_and_cut_at_hazards():
    moves = [KVMove(D, 0, H, 0), KVMove(D, 1, H, 1), KVMove(H, 0, K, 0), KVMove(H, 1, K, 1),
             KVMove(D, 2, H, 0), KVMove(D, 3, D, 4), KVMove(D, 4, D, 5), KVMove(D, 6, D, 5)]
    assert [len(r) for r in move_runs(moves)] == [2, 2, 1, 1, 1, 1]


def test_integrity_detects_a_hash_in_two_tiers_and_a_lost_slot():
    pool = BlockPool(1, tier_sizes=TierSizes(host_blocks=2))
    a = cache_one(pool, [1, 2, 3, 4])
    b = cache_one(pool, [5, 6, 7, 8])
    pool.check_integrity()
    entry = pool.lower.host.lookup(a)
    pool.lower.host._lru[b] = TierEntry(H, 1, b, entry.parent_hash, (5, 6, 7, 8))
    pool.lower.host._free.remove(1)
    with pytest.raises(IntegrityError, match="held in host and a faster tier"):
        pool.check_integrity()
    del pool.lower.host._lru[b]
    with pytest.raises(IntegrityError, match="do not partition"):
        pool.check_integrity()


def test_tier_sizes_and_config_validation():
    with pytest.raises(ValueError, match=">= 0 blocks"):
        TierSizes(host_blocks=-1)
    with pytest.raises(ValueError, match="set disk_kv_dir"):
        CacheConfig(disk_kv_bytes=1 << 20)
    with pytest.raises(ValueError, match="auto, swap or recompute"):
        CacheConfig(preemption_mode="never")

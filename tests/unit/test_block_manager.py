"""KV cache manager: prefix hits, token check on hit, salts, COW forks, exact block ids."""
import pytest

from engine.block_hash import block_hashes, packed_tokens, root_hash
from engine.block_manager import KVCacheManager, packed_blocks, packed_slice, prompt_blocks
from engine.block_pool import IntegrityError
from engine.kv_events import KVEventKind
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def req(rid, tokens, salt=None):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), cache_salt=salt)


def admit(kv, r):
    """Prefix lookup + allocation for the rest of the request, as the scheduler does."""
    computed = kv.get_computed_blocks(r)
    ids = kv.allocate_slots(r, r.num_tokens - computed.num_computed_tokens, computed)
    assert ids is not None
    r.num_computed_tokens = computed.num_computed_tokens
    return ids


def compute_all(kv, r):
    """Pretend the runner computed every known token."""
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r, r.num_computed_tokens)


def test_first_request_allocates_in_order_and_caches_only_full_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", range(10))
    assert kv.get_computed_blocks(a) == ((), 0)
    assert admit(kv, a) == [0, 1, 2]
    compute_all(kv, a)
    [ev] = kv.drain_events()
    assert ev.kind == KVEventKind.STORED
    assert ev.block_hashes == tuple(block_hashes(list(range(10)), BS)) == tuple(a.block_hashes)
    assert ev.parent_hash == root_hash(None)
    tables = kv.pool.blocks
    assert tables[2].block_hash is None            # partial block stays private
    assert kv.num_free_blocks == 5 and kv.usage == pytest.approx(3 / 8)
    kv.check_integrity()


def test_second_request_shares_the_cached_prefix():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", range(10))
    admit(kv, a)
    compute_all(kv, a)
    b = req("b", list(range(8)) + [50, 51, 52])
    computed = kv.get_computed_blocks(b)
    assert computed.block_ids == [0, 1] and computed.num_computed_tokens == 8
    assert kv.allocate_slots(b, 3, computed) == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert kv.prefix_cache_stats.queried_tokens == 10 + 11
    assert kv.prefix_cache_stats.hit_tokens == 8
    kv.check_integrity()


def test_full_prompt_hit_backs_off_one_token_and_uncaches_a_private_last_block():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", range(8))
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)
    h = a.block_hashes
    kv.drain_events()
    b = req("b", range(8))
    computed = kv.get_computed_blocks(b)
    assert computed.block_ids == [0, 1] and computed.num_computed_tokens == 7
    assert kv.allocate_slots(b, 1, computed) == [0, 1]        # no new block, no copy
    assert kv.take_block_copies() == []
    # block 1 is written again (its last token's logits are needed), so it leaves the cache ...
    assert [(e.kind, e.block_hashes) for e in kv.drain_events()] == [(KVEventKind.REMOVED, (h[1],))]
    b.num_computed_tokens = 8
    kv.cache_blocks(b, 8)
    # ... and comes back once computed, chained to block 0
    [ev] = kv.drain_events()
    assert (ev.kind, ev.block_hashes, ev.parent_hash) == (KVEventKind.STORED, (h[1],), h[0])
    kv.check_integrity()


def test_full_prompt_hit_on_a_shared_block_copies_it():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", range(8))
    admit(kv, a)
    compute_all(kv, a)                              # a still holds blocks 0, 1
    b = req("b", range(8))
    computed = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 1, computed) == [0, 2]
    assert kv.take_block_copies() == [(1, 2)]
    assert kv.take_block_copies() == []
    assert kv.pool.blocks[1].ref_cnt == 1 and kv.pool.blocks[0].ref_cnt == 2
    kv.check_integrity()


def test_salts_never_share_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", range(9), salt="tenant-a")
    admit(kv, a)
    compute_all(kv, a)
    assert kv.get_computed_blocks(req("b", range(9), salt="tenant-b")).num_computed_tokens == 0
    assert kv.get_computed_blocks(req("c", range(9))).num_computed_tokens == 0
    assert kv.get_computed_blocks(req("d", range(9), salt="tenant-a")).num_computed_tokens == 8


def test_hash_collision_is_refused_by_the_token_comparison():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", range(9))
    admit(kv, a)
    compute_all(kv, a)
    forged = req("forged", [7, 7, 7, 7, 7, 7, 7, 7, 7])
    forged.block_hashes = list(a.block_hashes)      # as if its tokens hashed to a's hashes
    assert kv.get_computed_blocks(forged) == ((), 0)
    # control: with a's own tokens the same hashes hit
    assert kv.get_computed_blocks(req("same", range(9))).num_computed_tokens == 8


def test_collision_with_equal_tokens_at_another_position_is_refused_by_the_parent():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, a)
    compute_all(kv, a)
    b = req("b", [5, 6, 7, 8, 0])                   # its block 0 has the tokens of a's block 1
    b.block_hashes = [a.block_hashes[1]]            # forged collision with a's block 1
    assert kv.get_computed_blocks(b) == ((), 0)


def test_eviction_order_is_lru_and_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = req("a", range(13))                         # blocks 0 1 2 full, 3 partial
    assert admit(kv, a) == [0, 1, 2, 3]
    compute_all(kv, a)
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    kv.drain_events()
    b = req("b", range(100, 116))                   # 4 unrelated blocks: reuse 3, 4, 5, evict a's tail
    assert admit(kv, b) == [3, 4, 5, 2]
    [ev] = kv.drain_events()
    assert ev.kind == KVEventKind.REMOVED and ev.block_hashes == (a.block_hashes[2],)
    c = req("c", range(13))
    computed = kv.get_computed_blocks(c)
    assert computed.block_ids == [0, 1] and computed.num_computed_tokens == 8
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = req("a", range(8))
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)
    b = req("b", list(range(8)) + list(range(50, 58)))   # hits 2 blocks, needs 2 more: only 1 left
    computed = kv.get_computed_blocks(b)
    assert computed.num_computed_tokens == 8
    assert kv.allocate_slots(b, 8, computed) is None
    assert kv.num_free_blocks == 3 and kv.get_block_ids("b") == []
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert kv.prefix_cache_stats.hit_tokens == 0
    kv.check_integrity()


def test_decode_grows_the_table_one_block_at_a_time():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", range(3))
    assert admit(kv, a) == [0]
    compute_all(kv, a)
    a.append_output_token(9)                        # 4 tokens, 3 computed: fits block 0
    assert kv.allocate_slots(a, 1) == [0]
    compute_all(kv, a)
    a.append_output_token(9)
    assert kv.allocate_slots(a, 1) == [0, 1]
    assert kv.pool.blocks[0].block_hash == a.block_hashes[0]


def test_fork_shares_everything_and_copies_the_partial_block_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = req("p", range(10))
    assert admit(kv, parent) == [0, 1, 2]
    compute_all(kv, parent)
    parent.append_output_token(20)
    child = req("c", range(10))
    child.append_output_token(21)
    child.num_computed_tokens = 10
    assert kv.fork(parent, child) == [0, 1, 2]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 2, 2]
    assert child.block_hashes == parent.block_hashes[:2]
    kv.check_integrity()
    # the child writes position 10 into shared block 2: it gets a copy
    assert kv.allocate_slots(child, 1) == [0, 1, 3]
    assert kv.take_block_copies() == [(2, 3)]
    # the parent now owns block 2 alone and writes in place
    assert kv.allocate_slots(parent, 1) == [0, 1, 2]
    assert kv.take_block_copies() == []
    kv.check_integrity()
    kv.free(child)
    kv.free(parent)
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_free_drops_pending_copies_into_its_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = req("p", range(6))
    admit(kv, parent)
    compute_all(kv, parent)
    child = req("c", range(6))
    child.append_output_token(1)
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    kv.allocate_slots(child, 1)
    kv.free(child)                                  # preempted in the same step
    assert kv.take_block_copies() == []


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = req("a", range(9))
    admit(kv, a)
    compute_all(kv, a)
    assert kv.get_computed_blocks(req("b", range(9))) == ((), 0)
    assert kv.drain_events() == []
    kv.check_integrity()


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", range(9))
    admit(kv, a)
    compute_all(kv, a)
    kv.reset_prefix_cache()
    assert kv.drain_events()[-1].kind == KVEventKind.CLEARED
    assert kv.get_computed_blocks(req("b", range(9))).num_computed_tokens == 0
    kv.check_integrity()
    kv.free(a)
    assert kv.num_free_blocks == 8


def test_manager_integrity_detects_a_stray_reference():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    admit(kv, req("a", range(5)))
    kv.pool.blocks[0].ref_cnt += 1
    with pytest.raises(IntegrityError, match="block 0 has ref_cnt 2 but 1 tables hold it"):
        kv.check_integrity()


def test_packed_slice_spans_prompt_and_output_like_the_joined_list():
    r = req("p", range(100, 110))
    for t in (7, 8, 9):
        r.append_output_token(t)
    joined = r.all_token_ids
    for lo, hi in [(0, 4), (4, 10), (8, 12), (10, 13), (0, 13), (12, 13)]:
        assert packed_slice(r, lo, hi) == packed_tokens(joined[lo:hi]), (lo, hi)
    assert r.prompt_packed == packed_tokens(range(100, 110))            # packed once, kept


@pytest.mark.parametrize("prompt_len", [8, 10, 12])
def test_packed_blocks_are_the_joined_lists_blocks(prompt_len):
    """Each block packed on its own, whether it lies in the prompt, in the
    output, or across the two (a prompt that does not end on a block)."""
    r = req("p", range(100, 100 + prompt_len))
    for t in range(7, 7 + 9):
        r.append_output_token(t)
    joined = r.all_token_ids
    full = len(joined) // BS
    for first in range(full + 1):
        for end in range(first, full + 1):
            assert packed_blocks(r, first, end, BS) == \
                [packed_tokens(joined[i * BS:(i + 1) * BS]) for i in range(first, end)], (first, end)


def test_given_prompt_blocks_are_what_the_cache_keeps_and_checks():
    """Blocks given with the request are stored as they are (no copy: requests
    sharing them share the bytes), are the token check of a lookup, and must be
    cut at the manager's block size."""
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    shared = tuple(packed_tokens(range(i * BS, (i + 1) * BS)) for i in range(2))
    a = Request("a", list(range(10)), SamplingParams(max_tokens=8), prompt_blocks=shared)
    admit(kv, a)
    compute_all(kv, a)
    cached = [kv.pool.lookup(h) for h in a.block_hashes]
    assert [b.token_ids for b in cached] == list(shared) and all(b.token_ids is s for b, s in zip(cached, shared))
    b = Request("b", list(range(10)), SamplingParams(max_tokens=8), prompt_blocks=shared)
    assert kv.get_computed_blocks(b).num_computed_tokens == 8
    lying = Request("c", list(range(10)), SamplingParams(max_tokens=8),
                    prompt_blocks=(shared[0], packed_tokens([9, 9, 9, 9])))   # hashes say equal, tokens differ
    assert kv.get_computed_blocks(lying).num_computed_tokens == 4
    cut_wrong = Request("d", list(range(10)), SamplingParams(max_tokens=8),
                        prompt_blocks=(packed_tokens(range(8)),))
    with pytest.raises(ValueError,
                       match=r"prompt_blocks holds 1 block\(s\) of 8 tokens; this KV manager's blocks hold 4"):
        kv.get_computed_blocks(cut_wrong)
    fresh = req("e", range(10))
    assert prompt_blocks(fresh, BS) == shared and fresh.prompt_blocks is prompt_blocks(fresh, BS)   # cut once


def test_a_given_packed_prompt_is_checked_and_hits_like_a_computed_one():
    with pytest.raises(ValueError, match="prompt_packed holds 8 bytes for 3 prompt tokens"):
        Request("bad", [1, 2, 3], SamplingParams(max_tokens=1), prompt_packed=packed_tokens([1, 2]))
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", range(10))
    admit(kv, a)
    compute_all(kv, a)
    given = Request("b", list(range(10)), SamplingParams(max_tokens=8), prompt_packed=packed_tokens(range(10)))
    assert kv.get_computed_blocks(given).num_computed_tokens == 8
    wrong = Request("c", list(range(10)), SamplingParams(max_tokens=8),
                    prompt_packed=packed_tokens([0, 1, 2, 3, 9, 9, 9, 9, 8, 9]))
    wrong.block_hashes = list(block_hashes(range(10), BS))             # hashes say equal, tokens differ
    assert kv.get_computed_blocks(wrong).num_computed_tokens == 4       # the token check uses the packed bytes

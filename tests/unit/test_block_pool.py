"""Block pool: free queue order, ref counts, prefix-cache map, KV events."""
import pytest

from engine.block_hash import block_hashes, packed_tokens, root_hash
from engine.block_pool import BlockPool, FreeBlockQueue, IntegrityError, KVBlock
from engine.kv_events import KVEventKind, Tier

BS = 4


def ids(blocks):
    return [b.block_id for b in blocks]


def cache(pool, blocks, tokens, salt=None):
    """Cache ``blocks`` as the full blocks of ``tokens``; returns their hashes."""
    hashes = block_hashes(tokens, BS, salt)
    chunks = [packed_tokens(tokens[i * BS:(i + 1) * BS]) for i in range(len(hashes))]
    pool.cache_full_blocks(blocks, hashes, chunks, root_hash(salt))
    return hashes


# ---- FreeBlockQueue ---------------------------------------------------------

def test_queue_remove_from_middle_head_and_tail():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4]
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert q.block_ids() == [1, 3] and len(q) == 2
    q.appendleft(blocks[4])
    q.append(blocks[0])
    assert q.block_ids() == [4, 1, 3, 0]
    assert q.popleft() is blocks[4]
    assert blocks[4].prev_free is None and blocks[4].next_free is None


def test_queue_rejects_double_insert_and_empty_pop():
    blocks = [KVBlock(0), KVBlock(1)]
    q = FreeBlockQueue(blocks[:1])
    with pytest.raises(AssertionError):
        q.append(blocks[0])           # alone in the queue: both links None, still detected
    with pytest.raises(AssertionError):
        q.remove(blocks[1])           # never inserted
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


@pytest.mark.parametrize("n", [0, 1, 3, 5])
def test_popleft_n_equals_n_poplefts(n):
    """Popping n blocks in one walk leaves the queue and every block's links as n
    single pops would (all of the queue, part of it, or nothing)."""
    def state(q, blocks):
        return q.block_ids(), len(q), [(b.prev_free, b.next_free) for b in blocks]

    one, many = [KVBlock(i) for i in range(5)], [KVBlock(i) for i in range(5)]
    q1, q2 = FreeBlockQueue(one), FreeBlockQueue(many)
    popped = [q1.popleft() for _ in range(n)]
    assert [b.block_id for b in q2.popleft_n(n)] == [b.block_id for b in popped]
    assert q2.block_ids() == q1.block_ids() and len(q2) == len(q1) == 5 - n
    assert [(p is None, x is None) for p, x in state(q2, many)[2]] == \
        [(p is None, x is None) for p, x in state(q1, one)[2]]
    q2.append(many[0]) if n else None                     # the queue still links correctly at both ends
    q1.append(one[0]) if n else None
    assert q2.block_ids() == q1.block_ids()
    with pytest.raises(IndexError):
        q2.popleft_n(len(q2) + 1)


# ---- allocation and freeing ---------------------------------------------------

def test_allocation_pops_head_in_order():
    pool = BlockPool(6)
    assert ids(pool.get_new_blocks(2)) == [0, 1]
    assert ids(pool.get_new_blocks(3)) == [2, 3, 4]
    assert pool.num_free_blocks == 1
    assert all(b.ref_cnt == 1 for b in pool.blocks[:5])
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.get_new_blocks(2)
    pool.check_integrity()


def test_free_puts_uncached_blocks_at_head_and_cached_at_tail():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)                      # 0 1 2
    cache(pool, a[:2], list(range(8)))              # 0, 1 cached; 2 partial
    pool.free_blocks(reversed(a))                   # tail first
    # 2 (uncached) is reused first; then the never-used 3 4 5; the cached 1, 0 last
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]
    pool.check_integrity()


def test_touch_removes_free_cached_block_from_the_middle():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    hashes = cache(pool, a, list(range(8)))
    pool.free_blocks(reversed(a))
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    hit = pool.lookup(hashes[1])
    assert hit is a[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.free_queue.block_ids() == [2, 3, 0]
    pool.touch([hit])
    assert hit.ref_cnt == 2
    pool.free_blocks([hit, hit])
    assert pool.free_queue.block_ids() == [2, 3, 0, 1]
    pool.check_integrity()


def test_double_free_is_an_integrity_error():
    pool = BlockPool(2)
    [b] = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(IntegrityError, match="freed with ref_cnt 0"):
        pool.free_blocks([b])


# ---- events -------------------------------------------------------------------

def test_stored_removed_cleared_events_with_ids_and_parents():
    pool = BlockPool(3)
    a = pool.get_new_blocks(2)
    hashes = cache(pool, a, list(range(8)), salt="t1")
    [stored] = pool.drain_events()
    assert (stored.event_id, stored.kind) == (1, KVEventKind.STORED)
    assert stored.block_hashes == tuple(hashes) and stored.parent_hash == root_hash("t1")
    assert stored.tier == Tier.DEVICE
    assert pool.drain_events() == []
    pool.free_blocks(reversed(a))                   # queue: 2, 1, 0
    pool.get_new_blocks(2)                          # takes 2 (never cached) and evicts 1
    [removed] = pool.drain_events()
    assert (removed.event_id, removed.kind, removed.block_hashes) == (2, KVEventKind.REMOVED, (hashes[1],))
    assert pool.lookup(hashes[1]) is None and a[1].block_hash is None
    assert pool.lookup(hashes[0]) is a[0]
    pool.reset_prefix_cache()
    [cleared] = pool.drain_events()
    assert (cleared.event_id, cleared.kind) == (3, KVEventKind.CLEARED)
    assert pool.lookup(hashes[0]) is None and a[0].block_hash is None
    pool.check_integrity()


def test_duplicate_hash_is_not_stored_twice_and_runs_keep_their_parent():
    pool = BlockPool(6)
    tokens = list(range(12))
    first = pool.get_new_blocks(1)
    h = cache(pool, first, tokens[:4])
    pool.drain_events()
    second = pool.get_new_blocks(3)                 # same content computed again by another request
    hashes = cache(pool, second, tokens)
    assert hashes[0] == h[0]
    assert second[0].block_hash is None             # stays private: the cache keeps block 0
    assert pool.lookup(h[0]) is first[0]
    [ev] = pool.drain_events()
    assert ev.block_hashes == tuple(hashes[1:]) and ev.parent_hash == hashes[0]
    pool.check_integrity()


def test_snapshot_for_resync():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    hashes = cache(pool, a, list(range(8)))
    snap = pool.snapshot()
    assert snap.last_event_id == 1 and set(snap.blocks[Tier.DEVICE]) == set(hashes)


def test_prefix_caching_off_stores_nothing_and_emits_nothing():
    pool = BlockPool(3, enable_caching=False)
    a = pool.get_new_blocks(2)
    hashes = cache(pool, a, list(range(8)))
    assert all(b.block_hash is None for b in a)
    assert pool.lookup(hashes[0]) is None
    pool.free_blocks(reversed(a))
    pool.get_new_blocks(3)
    pool.reset_prefix_cache()
    assert pool.drain_events() == []
    assert pool.snapshot().last_event_id == 0 and pool.snapshot().blocks[Tier.DEVICE] == ()
    pool.check_integrity()


# ---- integrity ----------------------------------------------------------------

def test_integrity_detects_ref_count_of_a_queued_block():
    pool = BlockPool(3)
    pool.blocks[1].ref_cnt = 1                      # claims to be used while in the free queue
    with pytest.raises(IntegrityError, match="block 1 ref_cnt 1, in free queue: True"):
        pool.check_integrity()


def test_integrity_detects_a_forged_hash():
    pool = BlockPool(3)
    [b] = pool.get_new_blocks(1)
    b.block_hash = 1234
    with pytest.raises(IntegrityError, match="carries hash"):
        pool.check_integrity()


def test_integrity_detects_a_leaked_block():
    pool = BlockPool(3)
    [b] = pool.get_new_blocks(1)
    b.ref_cnt = 0                                   # dropped without going back to the queue
    with pytest.raises(IntegrityError, match="free 2 \\+ used 0 != total 3"):
        pool.check_integrity()


def test_num_blocks_must_be_positive():
    with pytest.raises(ValueError, match="more memory"):
        BlockPool(0)

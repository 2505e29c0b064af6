"""Property tests of the tiers: random evict / page-in / swap sequences keep
every invariant, leak nothing, and never serve wrong KV.

The scheduler machine of test_block_manager_properties runs again with a host
and a disk tier and preemption by swap. Its fake KV store now has slots in
every tier and executes the step's ordered ``kv_moves`` one by one, so a
page-in from a wrong slot, a page-out recorded after the block was reused, or
a swap that loses a block shows up as a wrong fingerprint at a position a
running request reads. A second machine drives the batched executor
(TierStorage) with random move lists against the one-by-one reference.
"""
import random

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.kv_events import Tier
from engine.kv_pool import KVPool
from engine.request import Request
from engine.scheduler import Scheduler
from engine.tiers.cost import PreemptionPolicy
from engine.tiers.storage import TierStorage
from engine.tiers.types import KVMove, TierSizes
from test_block_manager_properties import SETTINGS, PREFIXES, FakeKV, SchedulerMachine, salt_st, tokens_st


class TieredFakeKV(FakeKV):
    """FakeKV whose host and disk slots hold fingerprints too."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.lower: dict[tuple[Tier, int], list] = {}

    def _get(self, tier: Tier, index: int) -> list:
        store = self.slots.get(index) if tier is Tier.DEVICE else self.lower.get((tier, index))
        return list(store or [None] * self.bs)

    def apply(self, moves: list[KVMove]) -> None:
        for m in moves:
            data = self._get(m.src_tier, m.src)
            if m.dst_tier is Tier.DEVICE:
                self.slots[m.dst] = data
            else:
                self.lower[(m.dst_tier, m.dst)] = data


class TieredSchedulerMachine(SchedulerMachine):
    @initialize(num_blocks=st.integers(4, 10), block_size=st.sampled_from([2, 4]),
                budget=st.integers(4, 16), max_seqs=st.integers(1, 4), chunked=st.booleans(),
                host=st.integers(0, 10), disk=st.integers(0, 6),
                mode=st.sampled_from(["swap", "swap", "recompute"]))
    def setup(self, num_blocks, block_size, budget, max_seqs, chunked, host, disk, mode):
        self.s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                           enable_chunked_prefill=chunked),
                           CacheConfig(block_size=block_size), num_blocks, max_model_len=64,
                           tier_sizes=TierSizes(host, disk), preemption=PreemptionPolicy(mode))
        self.fake = TieredFakeKV(block_size)
        self.n = 0
        self.held: set[str] = set()

    @rule(seed=st.integers(0, 2**16))
    def step(self, seed):
        rng = random.Random(seed)
        out = self.s.schedule()
        self.fake.apply(out.kv_moves)
        self.fake.copy([])          # block_copies are inside kv_moves already
        for seq in out.seqs:
            r = seq.request
            self.fake.write(r, seq.block_ids, r.num_computed_tokens, r.num_computed_tokens + seq.num_new_tokens)
        sampled = {q.request.request_id: [rng.randrange(4)] for q in out.seqs if q.sample}
        for r in self.s.update_from_output(out, sampled):
            if r.num_tokens >= r.max_total_tokens or rng.random() < 0.1:
                self._finish(r, _finished())

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), suffix=tokens_st, salt=salt_st)
    def add_remote(self, prefix, suffix, salt):
        r = self._new(prefix, suffix, salt, max_tokens=3)
        try:
            alloc = self.s.add_remote_request(r)
        except ValueError:
            return
        if alloc is not None:      # the engine flushes the moves before the pull writes
            self.fake.apply(self.s.kv.take_kv_moves())
            self.fake.write(r, list(alloc.block_ids), alloc.num_cached_tokens, r.num_prompt_tokens)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), suffixes=st.lists(tokens_st, min_size=1, max_size=3),
          salt=salt_st, steps=st.integers(1, 8), seed=st.integers(0, 2**16))
    def burst(self, prefix, suffixes, salt, steps, seed):
        """Requests sharing a prefix arrive together and run a while: pool
        pressure, so evictions, page-ins and preemptions happen often."""
        for suffix in suffixes:
            self.add(prefix, suffix, salt, max_tokens=10, hold=False)
        for i in range(steps):
            self.step(seed + i)

    @invariant()
    def tiers_hold_what_they_say(self):
        lower = self.s.kv.pool.lower
        for level in lower.levels:
            assert level.num_used <= level.num_slots


def _finished():
    from engine.request import RequestStatus
    return RequestStatus.FINISHED_LENGTH


TestTieredSchedulerMachine = TieredSchedulerMachine.TestCase
TestTieredSchedulerMachine.settings = settings(SETTINGS, stateful_step_count=30)


# ---- the batched executor against one-by-one moves ------------------------------------

MODEL = ModelConfig(architecture="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=4)
move_st = st.tuples(st.sampled_from(list(Tier)), st.integers(0, 3), st.sampled_from(list(Tier)),
                    st.integers(0, 3))


class StorageMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        import tempfile
        self.tmp = tempfile.TemporaryDirectory()
        pool = KVPool(MODEL, num_blocks=4, block_size=2, device="cpu", dtype=torch.float32)
        pool.tensor.copy_(torch.arange(pool.tensor.numel(), dtype=torch.float32).view_as(pool.tensor))
        self.storage = TierStorage(pool, TierSizes(4, 4), self.tmp.name)
        self.storage.apply([KVMove(Tier.DEVICE, i, t, i) for t in (Tier.HOST, Tier.DISK) for i in range(4)])
        self.ref = {t: [self._block(t, i).clone() for i in range(4)] for t in Tier}

    def _block(self, tier: Tier, i: int) -> torch.Tensor:
        if tier is Tier.DEVICE:
            return self.storage.kv_pool.tensor[i]
        if tier is Tier.HOST:
            return self.storage.host[i]
        return self.storage.disk.read([i])[0]

    @rule(moves=st.lists(move_st, max_size=8))
    def apply(self, moves):
        moves = [KVMove(*m) for m in moves]
        for m in moves:                             # the reference: one by one
            self.ref[m.dst_tier][m.dst] = self.ref[m.src_tier][m.src].clone()
        self.storage.apply(moves)

    @invariant()
    def same_as_one_by_one(self):
        for tier in Tier:
            for i in range(4):
                assert torch.equal(self._block(tier, i), self.ref[tier][i]), f"{tier.value} block {i}"
        assert self.storage.disk.file_bytes() <= self.storage.disk.max_bytes

    def teardown(self):
        self.storage.close()
        self.tmp.cleanup()


TestStorageMachine = StorageMachine.TestCase
TestStorageMachine.settings = SETTINGS

"""Property tests: random request lifecycles keep every invariant and leak nothing.

A fake KV store plays the model runner: each slot holds a fingerprint of
(salt, all tokens up to and including that position), i.e. what real K/V
depends on. Before every write the runner checks that every slot the step
would *read* holds the right fingerprint, so a wrong prefix hit, a missing
copy-on-write or a block reused while still in use fails the test.
"""
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.block_manager import KVCacheManager, cdiv
from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
PREFIXES = [[1, 2, 3, 1, 2], [1, 2, 3, 1, 3, 3, 0], [2, 2], [3]]
tokens_st = st.lists(st.integers(0, 3), max_size=6)
salt_st = st.sampled_from([None, "tenant"])


class FakeKV:
    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.slots: dict[int, list] = {}

    @staticmethod
    def fingerprint(request: Request, pos: int) -> int:
        return hash((request.cache_salt, tuple(request.all_token_ids[:pos + 1])))

    def copy(self, copies) -> None:
        for src, dst in copies:
            self.slots[dst] = list(self.slots.get(src, [None] * self.bs))

    def check(self, request: Request, table: list[int], end: int) -> None:
        for pos in range(end):
            got = self.slots.get(table[pos // self.bs], [None] * self.bs)[pos % self.bs]
            assert got == self.fingerprint(request, pos), \
                f"{request.request_id}: wrong KV at position {pos} (block {table[pos // self.bs]})"

    def write(self, request: Request, table: list[int], start: int, end: int) -> None:
        assert len(table) >= cdiv(end, self.bs), f"table {table} too short for {end} tokens"
        self.check(request, table, start)
        for pos in range(start, end):
            self.slots.setdefault(table[pos // self.bs], [None] * self.bs)[pos % self.bs] = \
                self.fingerprint(request, pos)


def make_prompt(prefix_idx: int, suffix: list[int]) -> list[int]:
    return PREFIXES[prefix_idx] + suffix or [0]


# ---- the manager alone --------------------------------------------------------------

class ManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 2, 4]),
                caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.fake = FakeKV(block_size)
        self.live: dict[str, Request] = {}
        self.n = 0

    def _run(self, r: Request, start: int, end: int) -> None:
        self.fake.copy(self.kv.take_block_copies())
        self.fake.write(r, self.kv.get_block_ids(r.request_id), start, end)
        r.num_computed_tokens = end
        self.kv.cache_blocks(r, end)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), suffix=tokens_st, salt=salt_st, token=st.integers(0, 3))
    def new_request(self, prefix, suffix, salt, token):
        self.n += 1
        r = Request(f"r{self.n}", make_prompt(prefix, suffix), SamplingParams(), cache_salt=salt)
        computed = self.kv.get_computed_blocks(r)
        assert computed.num_computed_tokens < r.num_tokens
        if self.kv.allocate_slots(r, r.num_tokens - computed.num_computed_tokens, computed) is None:
            return
        self.live[r.request_id] = r
        self._run(r, computed.num_computed_tokens, r.num_tokens)
        r.append_output_token(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if self.kv.allocate_slots(r, 1) is None:
            return
        self._run(r, r.num_computed_tokens, r.num_computed_tokens + 1)
        r.append_output_token(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def fork(self, data, token):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self.n += 1
        child = Request(f"r{self.n}", list(parent.prompt_token_ids), SamplingParams(),
                        cache_salt=parent.cache_salt, output_token_ids=parent.output_token_ids[:-1] + [token])
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        self.kv.free(self.live.pop(data.draw(st.sampled_from(sorted(self.live)))))

    @rule()
    def reset_prefix_cache(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def integrity(self):
        self.kv.check_integrity()
        for r in self.live.values():
            self.fake.check(r, self.kv.get_block_ids(r.request_id), r.num_computed_tokens)

    def teardown(self):
        for r in self.live.values():
            self.kv.free(r)
        self.kv.check_integrity()
        assert self.kv.num_free_blocks == self.kv.num_blocks, "blocks leaked"


# ---- the whole scheduler ----------------------------------------------------------

class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 12), block_size=st.sampled_from([2, 4]),
                budget=st.integers(4, 16), max_seqs=st.integers(1, 4), caching=st.booleans(),
                chunked=st.booleans())
    def setup(self, num_blocks, block_size, budget, max_seqs, caching, chunked):
        self.s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                           enable_chunked_prefill=chunked),
                           CacheConfig(block_size=block_size, enable_prefix_caching=caching),
                           num_blocks, max_model_len=64)
        self.fake = FakeKV(block_size)
        self.n = 0
        self.held: set[str] = set()

    def _new(self, prefix, suffix, salt, max_tokens, **kw) -> Request:
        self.n += 1
        return Request(f"r{self.n}", make_prompt(prefix, suffix), SamplingParams(max_tokens=max_tokens),
                       cache_salt=salt, arrival_time=float(self.n), **kw)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), suffix=tokens_st, salt=salt_st,
          max_tokens=st.integers(1, 6), hold=st.booleans())
    def add(self, prefix, suffix, salt, max_tokens, hold):
        try:
            self.s.add_request(self._new(prefix, suffix, salt, max_tokens, hold_kv_on_finish=hold))
        except ValueError:
            pass    # too big for this pool / budget: rejected up front, state untouched

    @rule(seed=st.integers(0, 2**16))
    def step(self, seed):
        rng = random.Random(seed)
        stuck_ok = self.s.num_held or self.s.num_remote
        out = self.s.schedule()
        assert out.seqs or out.preempted_ids or stuck_ok or not (self.s.num_running or self.s.num_waiting)
        assert out.num_tokens <= self.s.config.max_num_batched_tokens
        self.fake.copy(out.block_copies)
        for seq in out.seqs:
            r = seq.request
            self.fake.write(r, seq.block_ids, r.num_computed_tokens, r.num_computed_tokens + seq.num_new_tokens)
        sampled = {q.request.request_id: [rng.randrange(4)] for q in out.seqs if q.sample}
        for r in self.s.update_from_output(out, sampled):
            if r.num_tokens >= r.max_total_tokens or rng.random() < 0.1:
                self._finish(r, RequestStatus.FINISHED_LENGTH)

    def _finish(self, r: Request, status: RequestStatus) -> None:
        assert self.s.finish_request(r.request_id, status)
        if r.hold_kv_on_finish:
            self.held.add(r.request_id)

    def _pick(self, data, status):
        ids = sorted(rid for rid in self.s.queues.live_ids() if self.s.get_request(rid).status == status)
        return self.s.get_request(data.draw(st.sampled_from(ids))) if ids else None

    @rule(data=st.data(), token=st.integers(0, 3))
    def fork(self, data, token):
        parent = self._pick(data, RequestStatus.RUNNING)
        if parent is None or parent.num_tokens + 1 >= parent.max_total_tokens:
            return
        k = data.draw(st.integers(0, parent.num_output_tokens))
        self.n += 1
        child = Request(f"r{self.n}", list(parent.prompt_token_ids), parent.sampling_params,
                        cache_salt=parent.cache_salt, arrival_time=float(self.n),
                        output_token_ids=parent.output_token_ids[:k] + [token])
        self.s.fork_request(parent.request_id, child)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), suffix=tokens_st, salt=salt_st)
    def add_remote(self, prefix, suffix, salt):
        r = self._new(prefix, suffix, salt, max_tokens=3)
        try:
            alloc = self.s.add_remote_request(r)
        except ValueError:
            return
        if alloc is not None:      # the transfer engine fills the blocks it had to pull
            self.fake.write(r, list(alloc.block_ids), alloc.num_cached_tokens, r.num_prompt_tokens)

    @rule(data=st.data(), token=st.integers(0, 3), ok=st.booleans())
    def remote_done(self, data, token, ok):
        r = self._pick(data, RequestStatus.WAITING_FOR_REMOTE_KV)
        if r is not None and ok:
            self.s.remote_kv_ready(r.request_id, token)
        elif r is not None:
            self.s.remote_kv_failed(r.request_id)

    @rule(data=st.data())
    def abort(self, data):
        ids = sorted(set(self.s.queues.live_ids()) | self.held)
        if ids:
            rid = data.draw(st.sampled_from(ids))
            assert self.s.abort_request(rid)
            self.held.discard(rid)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.held)))
        assert self.s.release_held(rid) is True
        assert self.s.release_held(rid) is False
        self.held.discard(rid)

    @rule()
    def reset_prefix_cache(self):
        self.s.kv.reset_prefix_cache()

    @invariant()
    def integrity(self):
        self.s.check_integrity()
        for r in self.s.running:
            self.fake.check(r, self.s.kv.get_block_ids(r.request_id), r.num_computed_tokens)

    def teardown(self):
        for rid in sorted(set(self.s.queues.live_ids()) | self.held):
            assert self.s.abort_request(rid)
        self.s.check_integrity()
        assert not self.s.has_unfinished() and self.s.num_held == 0
        assert self.s.kv.num_free_blocks == self.s.kv.num_blocks, "blocks leaked"


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = SETTINGS
TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = SETTINGS

"""The router's whole decision in C (cluster/router/native_router.py, csrc/decide.c)
against the Python policy, decision by decision: two routers fed the same random KV
events (runs with parents, parentless stores, tiers, evictions that break prefix
closure, CLEARED, dead workers and snapshots), load reports, workers dying, leaving
and coming back, a clock that lets optimistic loads and in-flight entries lapse, and
prompts from shared prefixes. Every decision (worker, kind, hit counts, costs, the
records' loads and matches) and the view must be equal, in every mode: in-flight
tracking on and off, disaggregated and colocated. Then the hand-overs to Python (a
hash the tables cannot hold, a 65th worker) and the build's failure path."""
from __future__ import annotations

import logging
import random
from collections import Counter

import pytest

from cluster.router import (CostWeights, NoWorkerAvailable, PolicyConfig, Router, RouterConfig,
                            RoutingDecision, RoutingRequest, WorkerLoad)
from cluster.router import native
from engine.kv_events import KVEvent, KVEventKind, Tier
from test_router_index_search import _chains, _Feed

pytestmark = pytest.mark.skipif(native.module() is None, reason="no C compiler: the Python paths serve")

BS = 16


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


class _Routers:
    """What _Feed calls an index: the same events to both routers."""

    def __init__(self, routers: list[Router]) -> None:
        self.routers = routers

    def apply(self, w, events):
        results = [r.on_events(w, events) for r in self.routers]
        assert results[0] == results[1]
        return results[0]

    def resync(self, w, snapshot):
        for r in self.routers:
            r.on_snapshot(w, snapshot)

    def remove_worker(self, w):
        for r in self.routers:
            r.on_worker_dead(w)


def _pair(workers: list[str], clock: Clock, **config) -> tuple[Router, Router]:
    track = config.pop("track_in_flight", True)
    cfg = RouterConfig(policy_config=PolicyConfig(**config), pending_ttl_s=0.5, in_flight_ttl_s=0.7,
                       track_in_flight=track)
    pair = (Router(cfg, rng=random.Random(0), clock=clock),
            Router(cfg, rng=random.Random(0), clock=clock, native_decisions=False))
    for i, w in enumerate(workers):
        for r in pair:
            r.add_worker(w, "prefill" if i % 2 else "decode")
    assert pair[0]._fast is not None and pair[1]._fast is None
    return pair


def _same_route(fast: Router, py: Router, req: RoutingRequest) -> RoutingDecision | None:
    try:
        want = py.route(req)
    except NoWorkerAvailable:
        with pytest.raises(NoWorkerAvailable):
            fast.route(req)
        return None
    got = fast.route(req)
    assert type(got) is RoutingDecision and got == want, (got, want)
    assert repr(got.decode_inputs.cost) == repr(want.decode_inputs.cost)
    return got


ALL_QUEUES, BUSY_QUEUES = (0, 0, 64, 512, 4000), (64, 512, 4000)


def _churn(rng: random.Random, pair: tuple[Router, Router], feed: _Feed, clock: Clock,
           queues: tuple[int, ...] = ALL_QUEUES) -> None:
    """A load report (queued prefill tokens drawn from ``queues``), a death, a departure and
    return, or time passing."""
    workers = list(feed.model)
    w, roll = rng.choice(workers), rng.random()
    load = WorkerLoad(queued_prefill_tokens=rng.choice(queues), running=rng.choice([0, 1, 5]),
                      waiting=rng.randrange(3), kv_usage=rng.choice([0.0, 0.25, 0.9]))
    for r in pair:
        if roll < 0.5:
            r.update_load(w, load)
        elif roll < 0.6:
            r.on_worker_dead(w)
        elif roll < 0.65:
            r.remove_worker(w)
            r.add_worker(w, "prefill" if workers.index(w) % 2 else "decode")
    if 0.5 <= roll < 0.65:                      # the index forgot it: it reports from its first event again
        feed.model[w], feed.next_id[w] = {}, 1
    if roll >= 0.65:
        clock.t += rng.choice([0.0, 0.01, 0.2, 0.6, 1.5])


MODES = [dict(), dict(track_in_flight=False), dict(colocated=True),
         dict(local_prefill_threshold=0, local_prefill_hit_ratio=1.0,
              weights=CostWeights(uncached_token=1.0, host_hit=0.3, in_flight_hit=0.5, busy_pool_miss=3.5)),
         dict(local_prefill_threshold=0, local_prefill_hit_ratio=1.0,          # short hits count as none
              weights=CostWeights(host_hit=0.3, disk_hit=0.7, in_flight_hit=0.5, min_hit_share=0.4))]


def _compare(mode: int, n: int, seed: int, queues: tuple[int, ...]) -> Counter:
    """500 steps of events, churn and 3 decisions each, C against Python; how many decisions
    saw a prefill pool busy everywhere (every node with queued tokens: the miss weighs
    busy_pool_miss x more) and how many did not."""
    rng = random.Random(seed * 10 + mode)
    clock = Clock()
    workers = [f"w{i:02d}" for i in range(n)]
    fast, py = pair = _pair(workers, clock, **MODES[mode])
    feed = _Feed(rng, _Routers(list(pair)), workers)      # type: ignore[arg-type]
    chains = _chains(rng)
    kinds, busy = set(), Counter()
    for step in range(500):
        feed.step(chains)
        _churn(rng, pair, feed, clock, queues)
        for _ in range(3):
            chain = rng.choice(chains)
            blocks = rng.randint(0, len(chain))
            req = RoutingRequest(f"r{step}", max(1, blocks * BS + rng.randrange(BS)), tuple(chain[:blocks]), BS)
            busy[bool(py.view.prefill) and all(v.load.queued_prefill_tokens > 0 for v in py.view.prefill)] += 1
            d = _same_route(fast, py, req)
            if d is not None:
                kinds.add((d.kind, d.decode_inputs.match.in_flight_blocks > 0 or (
                    d.prefill_inputs is not None and d.prefill_inputs.match.in_flight_blocks > 0)))
        if step % 50 == 0:
            assert fast.view == py.view, step
    assert fast._fast is not None and fast.index.native_table is not None      # decided in C throughout
    assert len(kinds) >= (1 if MODES[mode].get("colocated") else 2), kinds
    return busy


@pytest.mark.parametrize("mode", range(len(MODES)))
@pytest.mark.parametrize("n,seed", [(6, 0), (40, 1), (64, 2)])
def test_the_c_decision_equals_the_python_policy(mode, n, seed):
    busy = _compare(mode, n, seed, ALL_QUEUES)
    assert busy[False] > 0 and (n > 6 or busy[True] > 0), busy


@pytest.mark.parametrize("mode", [0, 3, 4])
@pytest.mark.parametrize("n,seed", [(6, 3), (40, 4), (64, 5)])
def test_the_c_decision_equals_the_python_policy_on_a_pool_busy_everywhere(mode, n, seed):
    """Every load report has queued prefill tokens: most decisions weigh a miss
    busy_pool_miss x more (4, and 3.5 in mode 3), in the list and the array cost paths
    (not all: a worker that dies or returns reports no queue until its next report)."""
    busy = _compare(mode, n, seed, BUSY_QUEUES)
    assert busy[True] >= 100, busy


def test_a_hash_the_tables_cannot_hold_hands_over_to_python_with_the_pending_loads():
    clock = Clock()
    workers = [f"w{i}" for i in range(4)]
    fast, py = pair = _pair(workers, clock)
    for i in range(3):
        _same_route(fast, py, RoutingRequest(f"a{i}", 200, tuple(range(10 + i, 22 + i)), BS))
    _same_route(fast, py, RoutingRequest("wide", 200, (2**64, 5), BS))
    assert fast._fast is None and not fast.in_flight.native         # both tables and the decider: Python
    for i in range(20):
        clock.t += 0.1
        _same_route(fast, py, RoutingRequest(f"b{i}", 200, tuple(range(10 + i % 4, 22 + i % 4)), BS))
    assert fast.view == py.view


def test_a_65th_worker_hands_over_to_python():
    clock = Clock()
    workers = [f"w{i:02d}" for i in range(66)]
    fast, py = _pair(workers, clock)
    for i, w in enumerate(workers[:64]):
        for r in (fast, py):
            r.on_events(w, [KVEvent(1, KVEventKind.STORED, (1, 2 + i % 3), None, Tier.DEVICE)])
    _same_route(fast, py, RoutingRequest("a", 100, (1, 2), BS))
    assert fast._fast is not None
    for r in (fast, py):
        r.on_events("w64", [KVEvent(1, KVEventKind.STORED, (1, 2, 3), None, Tier.HOST)])
    for i in range(10):
        _same_route(fast, py, RoutingRequest(f"b{i}", 100, (1, 2, 3), BS))
    assert fast._fast is None and fast.view == py.view


def test_other_policies_and_temperatures_decide_in_python():
    def make(**kw) -> Router:
        policy = kw.pop("policy", "prefix_aware")
        return Router(RouterConfig(policy=policy, policy_config=PolicyConfig(**kw)), rng=random.Random(0),
                      clock=Clock())
    assert make()._fast is not None
    assert make(temperature=0.5)._fast is None and make(policy="round_robin")._fast is None
    assert make(weights=CostWeights(uncached_token=6))._fast is None     # int weights: int arithmetic


def test_no_compiler_means_python_decisions_with_a_log_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PDSERVE_KERNEL_DIR", str(tmp_path))
    native.module.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="cluster.router.native"):
            r = Router(RouterConfig(), rng=random.Random(0), clock=Clock())
        assert r._fast is None and r.index.native_table is None and not r.in_flight.native
        assert "C tables unavailable" in caplog.text
        r.add_worker("d", "decode")
        assert r.route(RoutingRequest("x", 64, (1, 2), BS)).decode_worker_id == "d"
    finally:
        native.module.cache_clear()

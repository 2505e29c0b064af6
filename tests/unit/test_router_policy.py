"""Routing policies and the Router, with exact expected choices."""
import random
from collections import Counter

import pytest

from cluster.config import ROUTER_POLICIES, ServeConfig
from cluster.observability.metrics import WorkerStats
from cluster.orchestration.router_config import router_config
from cluster.router import (POLICIES, ClusterView, CostWeights, DecisionKind, MatchInfo, NoWorkerAvailable,
                            PolicyConfig, PrefixIndex, Router, RouterConfig, RoutingRequest,
                            WorkerLoad, WorkerView, make_policy)
from engine.block_hash import block_hashes
from engine.kv_events import KVEvent, KVEventKind, KVSnapshot, Tier

BS = 16
PROMPT = list(range(2000))
HASHES = tuple(block_hashes(PROMPT, BS))          # 125 blocks


def req(rid="r", tokens=2000, hashes=HASHES):
    return RoutingRequest(rid, tokens, tuple(hashes), BS)


def cold(i, tokens=2000):
    return req(f"cold{i}", tokens, block_hashes([i * 7919 + t for t in range(tokens)], BS, f"salt{i}"))


def w(wid, pool, **load):
    return WorkerView(wid, pool, WorkerLoad(**load))


def index(**held):
    """held: worker -> number of leading prompt blocks (or (blocks, tier))."""
    idx = PrefixIndex()
    for wid, spec in held.items():
        n, tier = spec if isinstance(spec, tuple) else (spec, Tier.DEVICE)
        idx.apply(wid, [KVEvent(1, KVEventKind.STORED, HASHES[:n], None, tier)])
    return idx


def policy(name="prefix_aware", seed=0, **cfg):
    return make_policy(name, PolicyConfig(**cfg), random.Random(seed))


MISS = CostWeights().uncached_token     # queued tokens one uncached token weighs
TWO_BY_TWO = ClusterView.of([w("p0", "prefill"), w("p1", "prefill"), w("d0", "decode"), w("d1", "decode")])


# ---- prefix_aware -----------------------------------------------------------
def test_prefill_node_with_the_prefix_wins():
    d = policy().route(req(), TWO_BY_TWO, index(p1=100))
    assert (d.kind, d.prefill_worker_id, d.decode_worker_id) == (DecisionKind.REMOTE_PREFILL, "p1", "d0")
    assert (d.prefill_cached_tokens, d.decode_cached_tokens) == (1600, 0)
    assert d.prefill_inputs.match == MatchInfo(100) and d.prefill_inputs.candidates == 2
    assert d.prefill_inputs.cost == pytest.approx(MISS * 400.0)
    assert d.policy == "prefix_aware"


def test_prefix_holder_loses_when_its_queue_is_much_longer():
    # p1 holds 1600 of 2000 tokens: with p0 idle it keeps the request until its queue is MISS x 1600 long
    view = ClusterView.of([w("p0", "prefill"),
                           w("p1", "prefill", queued_prefill_tokens=int(MISS * 1600) + 100), w("d0", "decode")])
    assert policy().route(req(), view, index(p1=100)).prefill_worker_id == "p0"
    view = ClusterView.of([w("p0", "prefill"),
                           w("p1", "prefill", queued_prefill_tokens=int(MISS * 1600) - 100), w("d0", "decode")])
    assert policy().route(req(), view, index(p1=100)).prefill_worker_id == "p1"


@pytest.mark.parametrize("p0_queue", [1, 300])
def test_on_a_pool_busy_everywhere_a_miss_weighs_busy_pool_miss_times_more(p0_queue):
    """Every prefill node has a queue: the holder keeps the request until its queue is
    BUSY x MISS x 1600 longer than p0's (4 x the idle-pool margin), so the same views
    that send it away from a holder next to an idle node keep it at a busy pool."""
    busy = CostWeights().busy_pool_miss
    assert busy == 4.0
    for extra, holder_keeps in ((int(MISS * 1600) + 100, True), (int(busy * MISS * 1600) - 100, True),
                                (int(busy * MISS * 1600) + 100, False)):
        view = ClusterView.of([w("p0", "prefill", queued_prefill_tokens=p0_queue),
                               w("p1", "prefill", queued_prefill_tokens=p0_queue + extra), w("d0", "decode")])
        d = policy().route(req(), view, index(p1=100))
        assert d.prefill_worker_id == ("p1" if holder_keeps else "p0"), extra
        expected = busy * MISS * (400 if holder_keeps else 2000) + view.prefill[holder_keeps].load.queued_prefill_tokens
        assert d.prefill_inputs.cost == pytest.approx(expected)
    # busy_pool_miss = 1: the idle-pool margin whatever the queues (the weighting before)
    view = ClusterView.of([w("p0", "prefill", queued_prefill_tokens=p0_queue),
                           w("p1", "prefill", queued_prefill_tokens=p0_queue + int(MISS * 1600) + 100), w("d0", "decode")])
    assert policy(weights=CostWeights(busy_pool_miss=1.0)).route(req(), view, index(p1=100)).prefill_worker_id == "p0"


def test_a_holder_with_a_few_waiting_followers_keeps_its_group():
    """The case benchmarks/routing.py measured: a holder's report counts waiting requests'
    whole prompts (hits included). Two followers waiting on p1 (2 x 2000 tokens) must not
    send the third to p0, which would recompute 1600 tokens and cache them a second time."""
    view = ClusterView.of([w("p0", "prefill"), w("p1", "prefill", queued_prefill_tokens=4000),
                           w("d0", "decode")])
    d = policy().route(req(), view, index(p1=100))
    assert d.prefill_worker_id == "p1"
    assert d.prefill_inputs.cost == pytest.approx(MISS * 400 + 4000)
    # at the old 1 : 1 weighting the same view sent it away
    assert policy(weights=CostWeights(uncached_token=1.0)).route(req(), view, index(p1=100)).prefill_worker_id == "p0"


def test_device_hit_beats_an_equal_host_hit():
    d = policy().route(req(), TWO_BY_TWO, index(p0=(100, Tier.HOST), p1=100))
    assert d.prefill_worker_id == "p1"
    d = policy().route(req(), TWO_BY_TWO, index(p0=(120, Tier.HOST), p1=60))
    assert d.prefill_worker_id == "p0"                 # 96 effective blocks beat 60


def test_decode_node_chosen_by_load():
    view = ClusterView.of([w("p0", "prefill"), w("d0", "decode", running=10, kv_usage=0.5),
                           w("d1", "decode", running=2, kv_usage=0.1), w("d2", "decode", running=2, kv_usage=0.9)])
    d = policy().route(req(), view, index())
    assert d.decode_worker_id == "d1"
    assert d.decode_inputs.cost == pytest.approx(2 * 32 + 0.1 * 512 + 125)
    assert d.decode_inputs.candidates == 3


def test_decode_node_holding_part_of_the_prefix_is_preferred_at_equal_load():
    d = policy().route(req(), TWO_BY_TWO, index(d1=50))
    assert (d.decode_worker_id, d.kind, d.decode_cached_tokens) == ("d1", DecisionKind.REMOTE_PREFILL, 800)


def test_local_prefill_when_decode_holds_most_of_the_prefix():
    d = policy().route(req(), TWO_BY_TWO, index(d1=110, p0=125))
    assert (d.kind, d.decode_worker_id, d.prefill_worker_id) == (DecisionKind.LOCAL_PREFILL, "d1", None)
    assert d.prefill_cached_tokens == d.decode_cached_tokens == 1760
    assert d.prefill_inputs is None


def test_local_prefill_when_the_uncached_part_is_short():
    short = req("s", 50, HASHES[:3])
    d = policy().route(short, TWO_BY_TWO, index())
    assert d.kind is DecisionKind.LOCAL_PREFILL
    # the same prompt with a threshold below its length goes remote
    d = policy(local_prefill_threshold=32).route(short, TWO_BY_TWO, index())
    assert d.kind is DecisionKind.REMOTE_PREFILL


def test_remote_prefill_for_a_long_cold_prompt():
    assert policy().route(cold(1), TWO_BY_TWO, index()).kind is DecisionKind.REMOTE_PREFILL


def test_no_live_prefill_worker_falls_back_to_local_prefill():
    view = ClusterView.of([w("p0", "prefill", alive=False), w("d0", "decode")])
    d = policy().route(req(), view, index(p0=125))
    assert (d.kind, d.decode_worker_id) == (DecisionKind.LOCAL_PREFILL, "d0")


def test_no_live_decode_worker_raises():
    view = ClusterView.of([w("p0", "prefill"), w("d0", "decode", alive=False)])
    for name in POLICIES:
        with pytest.raises(NoWorkerAvailable):
            policy(name).route(req(), view, index())


def test_temperature_zero_is_deterministic_and_positive_temperature_favours_low_cost():
    view = ClusterView.of([w("p0", "prefill"), w("p1", "prefill"), w("p2", "prefill"), w("d0", "decode")])
    idx = index(p1=100, p2=50)
    cold_choices = {policy(seed=s).route(req(), view, idx).prefill_worker_id for s in range(20)}
    assert cold_choices == {"p1"}
    hot = policy(temperature=1.0, seed=1)
    counts = Counter(hot.route(req(f"r{i}"), view, idx).prefill_worker_id for i in range(3000))
    assert counts["p1"] > counts["p2"] > counts["p0"] > 0


# ---- colocated ----------------------------------------------------------------
COLO = ClusterView.of([w("c0", "colocated"), w("c1", "colocated"), w("c2", "colocated")])


def test_colocated_picks_the_prefix_holder_unless_it_is_loaded():
    d = policy(colocated=True).route(req(), COLO, index(c2=100))
    assert (d.kind, d.decode_worker_id, d.prefill_worker_id) == (DecisionKind.LOCAL_PREFILL, "c2", None)
    assert d.prefill_cached_tokens == 1600
    loaded = ClusterView.of([w("c0", "colocated"), w("c1", "colocated"),
                             w("c2", "colocated", running=40, queued_prefill_tokens=int(MISS * 1600))])
    assert policy(colocated=True).route(req(), loaded, index(c2=100)).decode_worker_id == "c0"


def test_colocated_round_robin_and_least_loaded():
    rr = policy("round_robin", colocated=True)
    assert [rr.route(req(), COLO, index()).decode_worker_id for _ in range(4)] == ["c0", "c1", "c2", "c0"]
    view = ClusterView.of([w("c0", "colocated", running=3), w("c1", "colocated", running=1),
                           w("c2", "colocated", running=2)])
    assert policy("least_loaded", colocated=True).route(req(), view, index(c0=125)).decode_worker_id == "c1"


# ---- baselines ------------------------------------------------------------------
def test_round_robin_cycles_and_ignores_the_prefix():
    view = ClusterView.of([w("p0", "prefill"), w("p1", "prefill"), w("p2", "prefill"),
                           w("d0", "decode"), w("d1", "decode")])
    rr = policy("round_robin")
    ds = [rr.route(cold(i), view, index(p2=125)) for i in range(6)]
    assert [d.prefill_worker_id for d in ds] == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert [d.decode_worker_id for d in ds] == ["d0", "d1", "d0", "d1", "d0", "d1"]


def test_least_loaded_picks_least_and_ignores_the_prefix():
    view = ClusterView.of([w("p0", "prefill", queued_prefill_tokens=300),
                           w("p1", "prefill", queued_prefill_tokens=100),
                           w("p2", "prefill", queued_prefill_tokens=200),
                           w("d0", "decode", running=5), w("d1", "decode", running=1, kv_usage=0.2)])
    d = policy("least_loaded").route(req(), view, index(p0=125))
    assert (d.prefill_worker_id, d.decode_worker_id) == ("p1", "d1")


def test_registry_matches_config_and_rejects_unknown_names():
    assert set(POLICIES) == set(ROUTER_POLICIES)
    with pytest.raises(ValueError, match="choose one of"):
        make_policy("random", PolicyConfig(), random.Random(0))


def test_bad_request_and_config_raise_value_error():
    with pytest.raises(ValueError, match="full blocks"):
        RoutingRequest("r", 20, HASHES[:2], BS)
    with pytest.raises(ValueError):
        RoutingRequest("r", 0, (), BS)
    with pytest.raises(ValueError):
        PolicyConfig(temperature=-1.0)
    with pytest.raises(ValueError):
        WorkerView("x", "gpu", WorkerLoad())


# ---- Router ---------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def router(policy_name="prefix_aware", clock=None, **cfg):
    r = Router(RouterConfig(policy=policy_name, policy_config=PolicyConfig(**cfg), pending_ttl_s=5.0),
               rng=random.Random(0), clock=clock or Clock())
    for wid, pool in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        r.add_worker(wid, pool)
    return r


def test_optimistic_accounting_spreads_a_burst_until_the_next_report():
    r = router()
    first, second = r.route(cold(1)), r.route(cold(2))
    assert (first.prefill_worker_id, second.prefill_worker_id) == ("p0", "p1")
    assert (first.decode_worker_id, second.decode_worker_id) == ("d0", "d1")
    by_id = {x.worker_id: x.load for x in r.view.prefill + r.view.decode}
    assert by_id["p0"].queued_prefill_tokens == 2000 and by_id["d0"].running == 1
    r.update_load("p0", WorkerLoad())
    assert r.route(cold(3)).prefill_worker_id == "p0"


def test_optimistic_additions_lapse_without_a_report():
    clock = Clock()
    r = router(clock=clock)
    assert r.route(cold(1)).prefill_worker_id == "p0"
    r.update_load("p1", WorkerLoad(queued_prefill_tokens=1000))
    assert r.route(cold(2)).prefill_worker_id == "p1"      # p0's 2000 optimistic tokens outweigh 1000
    clock.t += 6.0                                          # no report from p0: its addition lapsed
    assert r.route(cold(3)).prefill_worker_id == "p0"


def test_router_routes_to_the_prefix_holder_from_events_and_forgets_dead_workers():
    r = router()
    assert not r.on_events("p1", [KVEvent(1, KVEventKind.STORED, HASHES[:100])]).needs_resync
    assert r.route(req()).prefill_worker_id == "p1"
    r.on_worker_dead("p1")
    assert [x.worker_id for x in r.view.prefill] == ["p0"]
    assert r.index.match(HASHES) == {}
    assert r.route(req("again")).prefill_worker_id == "p0"
    r.update_load("p1", WorkerLoad())                   # restarted and reporting again
    assert [x.worker_id for x in r.view.prefill] == ["p0", "p1"]


def test_router_gap_then_snapshot():
    r = router()
    r.on_events("p1", [KVEvent(1, KVEventKind.STORED, HASHES[:10])])
    res = r.on_events("p1", [KVEvent(3, KVEventKind.STORED, HASHES[10:100])])
    assert res.needs_resync
    r.on_snapshot("p1", KVSnapshot(3, {Tier.DEVICE: HASHES[:100]}))
    assert r.index.match(HASHES)["p1"] == MatchInfo(100)
    assert r.route(req()).prefill_worker_id == "p1"


def test_observe_stats_registers_and_sets_load():
    r = router()
    r.observe_stats(WorkerStats("d2", "decode", running=0, waiting=0, kv_blocks_used=0,
                                kv_blocks_total=100, prefix_queried_tokens=0, prefix_hit_tokens=0))
    for wid in ("d0", "d1"):
        r.update_load(wid, WorkerLoad(running=8, kv_usage=0.5))
    assert r.route(cold(1)).decode_worker_id == "d2"
    r.observe_stats(WorkerStats("d2", "decode", running=9, waiting=2, kv_blocks_used=90,
                                kv_blocks_total=100, prefix_queried_tokens=0, prefix_hit_tokens=0))
    d2 = next(x for x in r.view.decode if x.worker_id == "d2")
    assert d2.load == WorkerLoad(0, 9, 2, 0.9, True)


def test_router_input_errors():
    r = router()
    with pytest.raises(ValueError, match="add_worker"):
        r.update_load("zz", WorkerLoad())
    with pytest.raises(ValueError, match="pool"):
        r.add_worker("p0", "decode")
    with pytest.raises(ValueError):
        r.add_worker("q", "gpu")


def test_router_config_from_serve_config():
    cfg = ServeConfig(router_policy="round_robin", router_temperature=0.5, local_prefill_threshold=8,
                      local_prefill_hit_ratio=0.5)
    rc = router_config(cfg)
    assert rc.policy == "round_robin"
    assert (rc.policy_config.temperature, rc.policy_config.local_prefill_threshold,
            rc.policy_config.local_prefill_hit_ratio) == (0.5, 8, 0.5)
    assert Router(rc, rng=random.Random(0), clock=Clock()).policy.name == "round_robin"


def test_view_patched_per_decision_equals_a_full_rebuild():
    rng = random.Random(11)
    clock = Clock()
    r = router(clock=clock)
    for step in range(300):
        op = rng.randrange(5)
        wid = rng.choice(["p0", "p1", "d0", "d1", "d2"])
        if op == 0 and wid == "d2":
            r.add_worker("d2", "decode")
        elif op == 1 and wid in r._slots:
            r.update_load(wid, WorkerLoad(queued_prefill_tokens=rng.randrange(3000), running=rng.randrange(9),
                                          kv_usage=rng.random(), alive=rng.random() < 0.8))
        elif op == 2 and wid in r._slots:
            r.on_worker_dead(wid)
        elif op == 3:
            clock.t += rng.choice([0.1, 3.0, 6.0])
        else:
            try:
                r.route(cold(step, rng.choice([40, 500, 2000])))
            except NoWorkerAvailable:
                pass
        patched = r.view
        r._view = None                                  # force a rebuild from the slots
        assert r.view == patched, f"step {step}"

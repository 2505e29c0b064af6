"""Small simulations: conservation, routing quality, the decode-run collapse."""
import pytest

from cluster.tools.sim.cli import without_wall
from cluster.tools.sim.cluster_sim import ClusterSim, SimConfig, descriptor_runs
from cluster.tools.sim.cost_model import Table2D, TableCostModel, TransferCost
from cluster.tools.sim.workload import PromptBuilder, TraceRequest, synthetic_shared_prefix

BS = 16


def _cost():
    prefill = Table2D("prefill", [1, 256, 1024], [0, 1024], [[0.002, 0.003], [0.02, 0.025], [0.08, 0.1]])
    decode = Table2D("decode", [1, 16], [0, 4096], [[0.002, 0.004], [0.004, 0.008]])
    return TableCostModel("test", prefill, decode, 0.001, TransferCost(1e-4, 1e-5, 1e9), 1000, 4096)


def _workload(n=120, rate=40.0, prefixes=6, seed=1):
    return synthetic_shared_prefix(n, rate, num_prefixes=prefixes, prefix_ids=6, suffix_ids=1,
                                   output_length=12, tokens_per_id=16, seed=seed)


def _run(policy="prefix_aware", p=2, d=2, collapse=True, num_blocks=128, reqs=None, **kw):
    cfg = SimConfig(p, d, policy=policy, block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=512,
                    max_num_seqs=16, max_model_len=2048, collapse=collapse, **kw)
    sim = ClusterSim(cfg, _cost(), reqs or _workload(), PromptBuilder(BS, tokens_per_id=16))
    return sim, sim.run()


@pytest.mark.parametrize("p", [0, 2])
def test_every_request_finishes_and_no_block_leaks(p):
    sim, s = _run(p=p)
    assert s["finished"] == s["requests"] == 120
    assert sim.router.open_sends == 0          # every prefill's end reached the router, as handoff.py's
    assert all(r.tokens_out == r.output_tokens for r in sim.records)
    assert all(r.first_token_s >= r.arrival_s and r.finish_s >= r.first_token_s for r in sim.records)
    for node in sim.nodes.values():
        sch = node.scheduler
        assert not sch.has_unfinished() and sch.num_held == 0
        sch.check_integrity()
        assert sch.kv.num_free_blocks == sch.kv.num_blocks
    if p:
        assert s["decisions"].get("remote_prefill", 0) > 0 and s["transfer"]["bytes"] > 0
    else:
        assert s["decisions"] == {"local_prefill": 120}


def test_prefix_aware_beats_round_robin_on_hit_rate():
    reqs = _workload(n=200, prefixes=8)
    _, aware = _run("prefix_aware", p=4, d=2, num_blocks=40, reqs=reqs)
    _, rr = _run("round_robin", p=4, d=2, num_blocks=40, reqs=reqs)
    assert aware["hit_rate_tokens"] > rr["hit_rate_tokens"] + 0.05


@pytest.mark.parametrize("n, rate, output_length, num_blocks, d", [
    (60, 10.0, 12, 128, 2),      # outputs shorter than a block
    (80, 20.0, 60, 128, 2),      # decodes fill blocks; hand-offs land inside runs
    (80, 40.0, 60, 48, 1),       # tight pool: preemptions and joins waiting for room
    (100, 60.0, 100, 64, 2),
])
def test_collapsed_decode_runs_match_step_by_step(n, rate, output_length, num_blocks, d):
    """Collapsing decode runs (and running hand-offs inside them) changes nothing
    the simulation reports: the same routing, cache hits, transfers, preemptions
    and times as one event per engine step. Blocks fill only at run ends, so the
    load reports and KV events the router sees mid-run are the step-by-step ones
    (allocating a run's blocks at its end once sent this test's second case to
    other nodes)."""
    reqs = synthetic_shared_prefix(n, rate, num_prefixes=6, prefix_ids=6, suffix_ids=1,
                                   output_length=output_length, tokens_per_id=16, seed=1)
    fast_sim, fast = _run(collapse=True, reqs=reqs, num_blocks=num_blocks, d=d)
    slow_sim, slow = _run(collapse=False, reqs=reqs, num_blocks=num_blocks, d=d)
    assert fast["finished"] == slow["finished"] == n
    assert fast["sim"]["node_runs"] < slow["sim"]["node_runs"]
    assert fast["sim"]["engine_steps"] == slow["sim"]["engine_steps"]
    assert fast["preemptions"] == slow["preemptions"]
    for a, b in zip(fast_sim.records, slow_sim.records):
        assert (a.prefill_node, a.decode_node, a.cached_tokens, a.decode_cached_tokens, a.transferred_blocks,
                a.descriptors, a.preempted) == (b.prefill_node, b.decode_node, b.cached_tokens,
                                                b.decode_cached_tokens, b.transferred_blocks, b.descriptors,
                                                b.preempted), a.request_id
        assert a.first_token_s == pytest.approx(b.first_token_s)
        assert a.finish_s == pytest.approx(b.finish_s)
    if output_length > BS:
        assert sum(node.deferred for node in fast_sim.nodes.values()) > 0, "no hand-off ran inside a run"


def test_descriptor_runs_count_runs_consecutive_on_both_sides():
    assert descriptor_runs([1, 2, 3], [7, 8, 9]) == 1
    assert descriptor_runs([1, 2, 3], [7, 9, 10]) == 2
    assert descriptor_runs([1, 5, 6], [7, 8, 9]) == 2
    assert descriptor_runs([], []) == 0


def test_config_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="decode node"):
        SimConfig(1, 0)
    with pytest.raises(ValueError, match="block size"):
        ClusterSim(SimConfig(1, 1, block_size=32), _cost(), _workload(), PromptBuilder(16, tokens_per_id=16))


@pytest.mark.parametrize("prefixes", [80, 20])
def test_joins_waiting_for_room_retry_only_when_room_changed(monkeypatch, prefixes):
    """A hand-off that found no room on its decode node is retried only when
    that node's free blocks or sequence slots, or the request's own prefix hits
    there, changed: the same results as retrying at every step boundary, with
    fewer `add_remote_request` calls. With 20 prefixes, hand-offs share prefixes
    on the decode node: a gate on its free and cached block counts alone skipped
    a join whose hits had changed while the counts came back equal."""
    import cluster.tools.sim.cluster_sim as cs
    from engine.scheduler import Scheduler

    calls = []
    real_add = Scheduler.add_remote_request
    monkeypatch.setattr(Scheduler, "add_remote_request", lambda self, r: calls.append(1) or real_add(self, r))
    reqs = _workload(n=80, rate=400.0, prefixes=prefixes)   # 80: no sharing, every request a remote prefill

    def run():
        calls.clear()
        sim, s = _run(p=3, d=1, num_blocks=40, reqs=reqs)
        return sim, s, len(calls)

    gated_sim, gated, gated_calls = run()
    monkeypatch.setattr(cs, "room", lambda scheduler, request: object())      # never equal: retry every boundary
    every_sim, every, every_calls = run()
    assert gated["finished"] == every["finished"] == 80
    assert every_calls > gated_calls > 80          # some joins did wait for room
    for a, b in zip(gated_sim.records, every_sim.records):
        assert (a.decode_cached_tokens, a.first_token_s, a.finish_s) == (b.decode_cached_tokens, b.first_token_s,
                                                                          b.finish_s)


def test_joins_waiting_for_room_are_reported_as_waiting(monkeypatch):
    """As DecodeWorker.report: a hand-off waiting on its decode node for KV room
    is a waiting request in the load the router sees; the count is exact at
    every report and back to zero at the end."""
    import cluster.tools.sim.cluster_sim as cs

    seen, real_tick = [], cs.ClusterSim._tick

    def tick(self):
        for nid, node in self.nodes.items():
            expected = sum(1 for live in self.live.values()
                           if live.joining and live.no_room is not None and live.rec.decode_node == nid)
            assert node.joining == expected, (nid, node.joining, expected)
            if node.joining:
                seen.append(node.joining)
        real_tick(self)

    monkeypatch.setattr(cs.ClusterSim, "_tick", tick)
    loads = []
    sim = ClusterSim(SimConfig(3, 1, block_size=BS, num_blocks=40, max_num_batched_tokens=512, max_num_seqs=16,
                               max_model_len=2048), _cost(), _workload(n=80, rate=400.0, prefixes=80),
                     PromptBuilder(BS, tokens_per_id=16))
    real_update = sim.router.update_load
    monkeypatch.setattr(sim.router, "update_load", lambda nid, load: loads.append((nid, load.waiting))
                        or real_update(nid, load))
    assert sim.run()["finished"] == 80
    assert seen, "no hand-off ever waited for room: the workload no longer exercises this"
    assert max(w for nid, w in loads if nid.startswith("d")) >= max(seen)
    assert all(node.joining == 0 for node in sim.nodes.values())


def test_run_leaves_the_garbage_collector_as_it_found_it():
    """run() freezes the long-lived nodes and raises the collection thresholds for its
    loop only; afterwards (also after a failure inside the loop) both are restored."""
    import gc
    before = gc.get_threshold()
    seen = {}
    sim, _ = _run(reqs=_workload(n=10))
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    sim2 = ClusterSim(sim.config, _cost(), _workload(n=10), PromptBuilder(BS, tokens_per_id=16))

    def boom():
        seen["threshold"], seen["frozen"] = gc.get_threshold(), gc.get_freeze_count()
        raise RuntimeError("inside the loop")

    sim2.loop.at(0.0, boom)
    with pytest.raises(RuntimeError, match="inside the loop"):
        sim2.run()
    assert seen["threshold"][0] >= 100_000 and seen["frozen"] > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_progress_lines_change_no_result(capsys):
    """--progress: a JSON line on stderr every progress_s simulated seconds, the last
    one with every request finished; the results are those of a run without it."""
    import json

    reqs = _workload(n=60, rate=20.0)
    _, quiet = _run(reqs=reqs)
    assert capsys.readouterr().err == ""
    _, loud = _run(reqs=reqs, progress_s=0.5)
    lines = [json.loads(line)["progress"] for line in capsys.readouterr().err.splitlines()]
    assert len(lines) >= 3 and [p["sim_s"] for p in lines] == sorted(p["sim_s"] for p in lines)
    assert lines[-1]["finished"] == lines[-1]["of"] == 60 and lines[-1]["live"] == 0
    for s in (quiet, loud):
        del s["sim"]["events"]                  # the progress events themselves
    assert without_wall(loud) == without_wall(quiet)
    with pytest.raises(ValueError, match="progress_s"):
        SimConfig(1, 1, progress_s=-1)


def _cold(rid: str, at: float, first_id: int) -> TraceRequest:
    return TraceRequest(rid, at, 256, 2, tuple(range(first_id, first_id + 16)))


@pytest.mark.parametrize("cores, together, want", [
    (0, True, (1.0, 1.0)),     # a core each
    (2, True, (1.0, 1.0)),     # two cores, one node on each
    (1, True, (2.0, 2.0)),     # one core: both prefills run at half speed
    (1, False, (1.0, 1.0)),    # one core, one prefill at a time: the partner idle costs nothing
])
def test_prefill_nodes_pinned_to_shared_cores_share_their_speed(cores, together, want):
    """prefill_cores: round-robin sends two cold 256-token prompts to the two prefill nodes; on
    one core the two steps, in flight together, each take twice the profile's time."""
    reqs = [_cold("a", 0.0, 100), _cold("b", 0.0 if together else 1.0, 200)]
    sim, s = _run("round_robin", p=2, d=1, reqs=reqs, prefill_cores=cores)
    assert s["finished"] == 2
    ttft = sorted((r.request_id, r.ttft) for r in sim.records)
    base = _run("round_robin", p=2, d=1, reqs=[_cold("a", 0.0, 100)])[0].records[0].ttft   # alone
    assert [round(t / base, 2) for _, t in ttft] == list(want), ttft


def test_prefill_cores_is_checked():
    with pytest.raises(ValueError, match="prefill_cores must be >= 0"):
        SimConfig(2, 1, prefill_cores=-1)

"""The simulator reserves a hand-off's decode blocks when it is routed, as the live
cluster does (`reserve_decode_blocks`): held on the decode node while the prompt is
prefilled, claimed by the join, freed when nobody claims them; nothing leaks."""
from __future__ import annotations

import pytest

from cluster.tools.sim.cluster_sim import ClusterSim, SimConfig
from cluster.tools.sim.cost_model import Table2D, TableCostModel, TransferCost
from cluster.tools.sim.reservation import RESERVATION_TTL_FACTOR
from cluster.tools.sim.workload import PromptBuilder, TraceRequest

BS = 16


def _cost():
    # ~1.3k prompt tokens/s on a prefill node: a 256-token prompt takes 0.2 s; 10 ms decode steps
    prefill = Table2D("prefill", [1, 256, 1024], [0, 1024], [[0.01, 0.01], [0.2, 0.2], [0.8, 0.8]])
    decode = Table2D("decode", [1, 16], [0, 4096], [[0.01, 0.01], [0.01, 0.012]])
    return TableCostModel("test", prefill, decode, 0.001, TransferCost(1e-4, 1e-5, 1e9), 1000, 4096)


def _requests(n: int, gap: float, output_length: int = 8) -> list[TraceRequest]:
    """Unique 256-token prompts (16 blocks: prefilled remotely), one every ``gap`` s."""
    return [TraceRequest(f"r{i}", i * gap, 256, output_length, tuple(range(16 * i, 16 * i + 16)))
            for i in range(n)]


def _sim(reqs, reserve=True, num_blocks=128, p=1, **kw) -> ClusterSim:
    cfg = SimConfig(p, 1, block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=512, max_num_seqs=16,
                    max_model_len=2048, reserve_decode_blocks=reserve, **kw)
    return ClusterSim(cfg, _cost(), reqs, PromptBuilder(BS, tokens_per_id=16))


def _no_leak(sim: ClusterSim) -> None:
    assert not sim.live
    for node in list(sim.nodes.values()) + sim.retired:
        sch = node.scheduler
        assert not sch.has_unfinished() and sch.num_held == 0 and sch.num_remote == 0
        sch.check_integrity()
        assert sch.kv.num_free_blocks == sch.kv.num_blocks


@pytest.mark.parametrize("reserve", [True, False])
def test_blocks_are_held_on_the_decode_node_while_the_prompt_prefills(monkeypatch, reserve):
    """When each prefill ends, the decode node already holds the request's 16 prompt blocks in
    its remote queue, the join pulls into exactly those, and the load the router got during the
    prefill (0.2 s) counted them as used KV with nothing running. Without the reservation, the
    decode node holds nothing for it until the join, and reports no KV in use meanwhile."""
    sim = _sim(_requests(3, 1.0), reserve=reserve)
    held, seen, loads, real_finished = {}, {}, [], ClusterSim.on_finished
    decode = sim.nodes["d0000"]

    def on_finished(self, node, request, t):
        if node.role == "prefill":
            rid = request.request_id
            held[rid] = (rid in decode.scheduler.queues.remote, decode.scheduler.kv.get_block_ids(rid))
            seen[rid] = [load for nid, load in loads if nid == "d0000"][-1]   # the router's latest
        real_finished(self, node, request, t)
    monkeypatch.setattr(ClusterSim, "on_finished", on_finished)
    real_update = sim.router.update_load
    monkeypatch.setattr(sim.router, "update_load", lambda nid, load: loads.append((nid, load))
                        or real_update(nid, load))
    pulled, real_pull = {}, ClusterSim._pull

    def pull(self, dn, pn, live, alloc):
        pulled[live.request_id] = list(alloc.block_ids)
        real_pull(self, dn, pn, live, alloc)
    monkeypatch.setattr(ClusterSim, "_pull", pull)
    s = sim.run()
    assert s["finished"] == 3 and set(held) == {"r0", "r1", "r2"}
    counts = s["sim"]["decode_reservations"]
    assert all(load.running == 0 for load in seen.values())
    if reserve:
        assert all(in_remote and len(ids) == 16 for in_remote, ids in held.values())
        assert all(pulled[rid] == held[rid][1] for rid in held)
        assert counts == {"made": 3, "refused": 0, "claimed": 3, "freed": 0, "expired": 0}
        assert all(load.kv_usage == 16 / 128 for load in seen.values())
    else:
        assert all(not in_remote and not ids for in_remote, ids in held.values())
        assert counts == {"made": 0, "refused": 0, "claimed": 0, "freed": 0, "expired": 0}
        assert all(load.kv_usage == 0 for load in seen.values())
    assert all(r.tokens_out == r.output_tokens for r in sim.records)
    _no_leak(sim)


def test_a_reservation_nobody_claims_is_freed():
    """The first token ends the request (output of 1): its reservation is freed, not pulled into."""
    sim = _sim(_requests(4, 0.5, output_length=1))
    s = sim.run()
    assert s["finished"] == 4 and s["transfer"]["bytes"] == 0
    assert s["sim"]["decode_reservations"] == {"made": 4, "refused": 0, "claimed": 0, "freed": 4, "expired": 0}
    _no_leak(sim)


def test_reservations_expire_refuse_and_still_every_request_finishes_once():
    """30 prompts at once over 15 prefill nodes (two each, fewer than a step's tokens queued
    ahead of either, so all are reserved) on a decode node of 64 blocks: 4 reservations fit, the
    rest are refused and join after their prefill, waiting for room; reservations live 6
    transfer timeouts (0.03 s x 6 = 0.18 s), less than a prompt's prefill (0.2 s), so they expire and
    their joins allocate anew (or, without room by their deadline, recompute on the decode node).
    Every request finishes once with all its tokens, and no block or sequence is left anywhere."""
    sim = _sim(_requests(30, 0.0), num_blocks=64, p=15, transfer_timeout_s=0.03)
    s = sim.run()
    counts = s["sim"]["decode_reservations"]
    assert s["finished"] == 30 and len({r.request_id for r in sim.records}) == 30
    assert all(r.tokens_out == r.output_tokens for r in sim.records)
    assert counts["made"] == counts["expired"] == 4 and counts["refused"] == 26
    assert counts["made"] + counts["refused"] == 30
    assert counts["made"] == counts["claimed"] + counts["expired"] + counts["freed"]
    _no_leak(sim)


def test_a_prompt_behind_a_prefill_backlog_reserves_nothing():
    """30 prompts at once on one prefill node (two per 512-token step): only the two that start
    with its first step have fewer than a step's tokens queued ahead (cluster/router/reserve.py)
    and reserve; the 28 behind them reserve nothing and allocate at their join. Every request
    finishes once, nothing is left."""
    sim = _sim(_requests(30, 0.0), num_blocks=128)
    s = sim.run()
    counts = s["sim"]["decode_reservations"]
    assert s["finished"] == 30 and all(r.tokens_out == r.output_tokens for r in sim.records)
    assert counts["made"] + counts["refused"] == 2 and counts["made"] == counts["claimed"] == 2
    _no_leak(sim)


def test_a_load_step_with_reservations_keeps_the_goodput_of_the_flow_without():
    """tests/unit/test_sim_autoscale.py's load step (1 + 1 nodes of 64 blocks, 10x, autoscaled):
    reserving for every routed hand-off filled the decode nodes with prompts still queued for
    prefill (goodput 0.387 against 0.588 without reservations); reserving only for prefills that
    start within a step keeps nearly all of it (0.580; 590 of the 1,380 hand-offs reserved)."""
    import test_sim_autoscale as step
    reqs = step._step_workload()
    _, on = step._run(reqs, autoscale=step._autoscale(), reserve=True)
    _, off = step._run(reqs, autoscale=step._autoscale(), reserve=False)
    counts = on["sim"]["decode_reservations"]
    # every hand-off is remote here: some reserved, not those behind the step's backlog
    assert 0 < counts["made"] + counts["refused"] < len(reqs) and counts["made"] == counts["claimed"]
    assert on["goodput"]["fraction"] >= off["goodput"]["fraction"] - 0.02
    assert on["ttft_s"]["p90"] <= 1.1 * off["ttft_s"]["p90"]


def test_the_lifetime_is_the_decode_workers():
    from decode_worker.worker import RESERVATION_TTL_FACTOR as live
    assert RESERVATION_TTL_FACTOR == live


@pytest.mark.parametrize("transfer_timeout_s", [0.048, 0.076])
def test_a_join_that_comes_while_its_reservation_expires_waits_for_the_expiry(transfer_timeout_s):
    """30 prompts 20 ms apart over 4 prefill nodes, 64 tokens out each (the decode node runs
    long): one reservation expires after its prefill ended but before its join ran (the join
    deferred to the end of the decode step in flight), so its abort still waits on the decode
    node, where the request id is in use. The join waits for the abort, then allocates anew.
    It used to allocate at once and the decode node refused the id ("already in use"): the
    crash routing_sim met at the Mooncake replay's extreme queues. Every request finishes once."""
    sim = _sim(_requests(30, 0.02, output_length=64), num_blocks=128, p=4, transfer_timeout_s=transfer_timeout_s)
    s = sim.run()
    assert sim.reservations.joins_held >= 1, "the scenario no longer has a join meet its reservation's expiry"
    assert s["finished"] == 30 and len({r.request_id for r in sim.records}) == 30
    assert all(r.tokens_out == r.output_tokens for r in sim.records)
    counts = s["sim"]["decode_reservations"]
    assert counts["made"] == counts["claimed"] + counts["expired"] + counts["freed"] and counts["expired"] >= 1
    _no_leak(sim)

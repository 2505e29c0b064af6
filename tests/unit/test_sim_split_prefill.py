"""The split-prefill what-if (cluster/tools/sim/split_prefill.py): a long cold prefill spread over two nodes."""
import pytest

from cluster.tools.sim.cluster_sim import ClusterSim, SimConfig
from cluster.tools.sim.cost_model import Table2D, TableCostModel, TransferCost
from cluster.tools.sim.cost_model import prefill_alone_s
from cluster.tools.sim.split_prefill import SplitPrefill
from cluster.tools.sim.workload import PromptBuilder, TraceRequest

BS, STEP = 16, 512


def _cost():
    prefill = Table2D("prefill", [1, 256, 1024], [0, 4096], [[0.002, 0.004], [0.02, 0.03], [0.08, 0.12]])
    decode = Table2D("decode", [1, 16], [0, 4096], [[0.002, 0.004], [0.004, 0.008]])
    return TableCostModel("test", prefill, decode, 0.001, TransferCost(1e-4, 1e-5, 1e9), 1000, 8192)


def _req(rid, t, tokens, first_id):
    return TraceRequest(rid, t, tokens, 2, tuple(range(first_id, first_id + tokens // BS)))


def _run(reqs, split=None, policy="round_robin"):
    cfg = SimConfig(2, 1, policy=policy, block_size=BS, num_blocks=512, max_num_batched_tokens=STEP,
                    max_num_seqs=16, max_model_len=4096, split_prefill=split)
    sim = ClusterSim(cfg, _cost(), reqs, PromptBuilder(BS, tokens_per_id=BS))
    return sim, sim.run()


def _ttft(sim, rid):
    r = next(r for r in sim.records if r.request_id == rid)
    return r.first_token_s - r.arrival_s


def test_a_lone_long_cold_prompt_finishes_in_the_modelled_share_of_its_alone_time():
    reqs = [_req("long", 0.0, 2048, 0)]          # 4 chunks of 512: (C + 1) / (2 C) = 5 / 8
    off_sim, _ = _run(reqs)
    alone = prefill_alone_s(_cost().pure_prefill, STEP, 2048, 0)
    assert _ttft(off_sim, "long") == pytest.approx(alone, rel=1e-9)
    on_sim, s = _run(reqs, SplitPrefill(min_tokens=1024))
    assert s["split_prefill"]["splits"] == 1
    assert _ttft(on_sim, "long") == pytest.approx(alone * 5 / 8, rel=1e-9)
    # a pipeline chunk of 128 tokens: 16 chunks, (16 + 1) / 32
    fine_sim, _ = _run(reqs, SplitPrefill(min_tokens=1024, chunk_tokens=128))
    assert _ttft(fine_sim, "long") == pytest.approx(alone * 17 / 32, rel=1e-9)


def test_below_the_threshold_or_off_nothing_changes():
    reqs = [_req("a", 0.0, 2048, 0), _req("b", 0.01, 1024, 10_000), _req("c", 0.02, 1536, 20_000)]
    off_sim, off = _run(reqs)
    high_sim, high = _run(reqs, SplitPrefill(min_tokens=4096))
    assert high["split_prefill"]["splits"] == 0
    assert [(r.prefill_node, r.first_token_s, r.finish_s) for r in off_sim.records] == \
        [(r.prefill_node, r.first_token_s, r.finish_s) for r in high_sim.records]
    assert "split_prefill" not in off


def test_the_helper_takes_nothing_else_until_the_split_prefill_ends():
    # round-robin: "long" on p0000 (p0001 idle: lent), "short" on p0001 while it is lent
    reqs = [_req("long", 0.0, 2048, 0), _req("short", 0.05, 256, 10_000)]
    on_sim, s = _run(reqs, SplitPrefill(min_tokens=1024))
    long_rec, short_rec = (next(r for r in on_sim.records if r.request_id == k) for k in ("long", "short"))
    assert (long_rec.prefill_node, short_rec.prefill_node) == ("p0000", "p0001")
    short_alone = prefill_alone_s(_cost().pure_prefill, STEP, 256, 0)
    # it starts when the long prompt's first token frees p0001, not on arrival
    assert short_rec.first_token_s == pytest.approx(long_rec.first_token_s + short_alone, rel=1e-9)
    off_sim, _ = _run(reqs)
    assert _ttft(off_sim, "short") == pytest.approx(short_alone, rel=1e-9)
    assert s["split_prefill"]["helper_lent_s"] == pytest.approx(long_rec.first_token_s, abs=1e-3)   # rounded


def test_no_idle_helper_no_split():
    # "b" (below the threshold) is computing on p0000 when "long" is admitted on p0001
    reqs = [_req("b", 0.0, 512, 10_000), _req("long", 0.001, 2048, 0)]
    sim, s = _run(reqs, SplitPrefill(min_tokens=1024))
    assert s["split_prefill"]["splits"] == 0
    assert _ttft(sim, "long") == pytest.approx(prefill_alone_s(_cost().pure_prefill, STEP, 2048, 0), rel=1e-9)


def test_a_link_adds_the_activation_hand_offs_and_the_kv_copy():
    reqs = [_req("long", 0.0, 2048, 0)]
    cfg = SplitPrefill(min_tokens=1024, link_gbps=0.01)        # slow enough to count
    sim, _ = _run(reqs, cfg)
    alone = prefill_alone_s(_cost().pure_prefill, STEP, 2048, 0)
    h = 576 * STEP * 4 / (0.01e9 / 8)
    t_c = alone / 4
    expect = t_c + h + 3 * max(t_c / 2, h) + 2048 * 1000 / 2 / (0.01e9 / 8)
    assert _ttft(sim, "long") == pytest.approx(expect, rel=1e-9)
    # a pipeline chunk of 128 tokens is priced at its own size: 16 steps of 128 on one node, over 16
    sim, _ = _run(reqs, SplitPrefill(min_tokens=1024, link_gbps=0.01, chunk_tokens=128))
    h, t_c = 576 * 128 * 4 / (0.01e9 / 8), prefill_alone_s(_cost().pure_prefill, 128, 2048, 0) / 16
    assert t_c > alone / 16
    expect = t_c + h + 15 * max(t_c / 2, h) + 2048 * 1000 / 2 / (0.01e9 / 8)
    assert _ttft(sim, "long") == pytest.approx(expect, rel=1e-9)


def test_config_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="min_tokens must be >= 1"):
        SplitPrefill(min_tokens=0)
    with pytest.raises(ValueError, match="at least one helper"):
        SplitPrefill(min_tokens=10, nodes=1)
    with pytest.raises(ValueError, match="--prefill-nodes >= 3"):
        SimConfig(2, 1, split_prefill=SplitPrefill(min_tokens=10, nodes=3))

"""Cost-model interpolation and the JSON profile format."""
import json

import numpy as np
import pytest

from cluster.tools.sim.cost_model import Table2D, TableCostModel, TransferCost, load_cost_model
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledSeq, SchedulerOutput


def _model(overhead=0.001):
    prefill = Table2D("prefill", [100, 200], [0, 1000], [[1.0, 2.0], [3.0, 4.0]])
    decode = Table2D("decode", [1, 3], [0, 100], [[0.01, 0.02], [0.03, 0.05]])
    return TableCostModel("t", prefill, decode, overhead, TransferCost(1e-3, 1e-4, 1e9), 1000, 10_000)


def test_bilinear_inside_and_linear_outside():
    t = _model().prefill
    assert t(100, 0) == 1.0 and t(200, 1000) == 4.0
    assert t(150, 500) == pytest.approx(2.5)        # centre of the cell
    assert t(300, 0) == pytest.approx(5.0)          # extrapolated along the first axis
    assert t(100, 2000) == pytest.approx(3.0)       # and the second
    assert t(0, 0) == 0.0                           # clamped at zero (would be -1)


def test_decode_run_matches_single_steps():
    m = _model()
    run = m.decode_run(batch=2, context0=10, steps=5)
    single = [m.decode(2, 10 + 2 * i) for i in range(5)]
    assert np.allclose(run, single)


@pytest.mark.parametrize("signed", [False, True])
def test_along_y_is_the_pointwise_rule_everywhere(signed):
    """The vectorised row (memoised per x) equals __call__ inside the grid, when
    extrapolated on either axis, clamped (or not, signed), and for a one-column grid;
    asking again for the same x (the memo) changes nothing."""
    t = Table2D("t", [1, 4, 8], [0, 100, 1000], [[0.5, 0.2, 3.0], [1.0, 1.5, 2.0], [2.0, 0.1, 9.0]], signed=signed)
    one = Table2D("one", [1, 4], [64], [[0.5], [2.0]])
    ys = np.array([-500.0, 0.0, 37.0, 100.0, 550.0, 1000.0, 5000.0])
    for x in (0.0, 1.0, 2.5, 4.0, 6.0, 8.0, 20.0, 2.5):
        for table in (t, one):
            got = table.along_y(x, ys)
            assert np.allclose(got, [table(x, y) for y in ys], rtol=1e-12, atol=0.0), (table.name, x)
    assert (t.along_y(20.0, ys) < 0).any() == signed        # far out, a signed table goes below zero


def _seq(prompt_len, computed, n):
    r = Request("r%d" % computed, list(range(prompt_len)), SamplingParams(max_tokens=4))
    r.num_computed_tokens = computed
    if computed >= prompt_len:
        r.output_token_ids.append(1)
    return ScheduledSeq(r, n, [], True)


def test_step_seconds_splits_prefill_and_decode_and_pays_overhead_once():
    m = _model(overhead=0.001)
    pre = SchedulerOutput([_seq(150, 0, 150)])
    dec = SchedulerOutput([_seq(10, 10, 1), _seq(20, 20, 1)])
    mixed = SchedulerOutput(pre.seqs + dec.seqs)
    assert m.step_seconds(pre) == pytest.approx(m.prefill(150, 0))
    assert m.step_seconds(dec) == pytest.approx(m.decode(2, 11 + 21))
    assert m.step_seconds(mixed) == pytest.approx(m.step_seconds(pre) + m.step_seconds(dec) - 0.001)


def test_transfer_is_fixed_plus_descriptors_plus_bytes():
    m = _model()
    assert m.transfer_seconds(3, 2_000_000) == pytest.approx(1e-3 + 3e-4 + 2e-3)
    assert m.transfer_seconds(0, 0) == 0.0


def test_json_round_trip_and_shipped_profiles(tmp_path):
    m = _model()
    path = tmp_path / "p.json"
    m.save(path)
    back = load_cost_model(str(path))
    assert back.prefill(150, 500) == m.prefill(150, 500) and back.kv_capacity_tokens == 10_000
    for name in ("h100", "a100"):
        p = load_cost_model(name)
        assert "derived" in p.meta["source"]
        assert p.pure_prefill(8192, 0) > p.pure_prefill(1024, 0) > 0
    assert load_cost_model("a100").pure_prefill(8192, 0) > load_cost_model("h100").pure_prefill(8192, 0)


def test_bad_tables_say_how_to_fix(tmp_path):
    with pytest.raises(ValueError, match="strictly increasing"):
        Table2D("x", [2, 1], [0], [[1.0], [2.0]])
    with pytest.raises(ValueError, match="rows"):
        Table2D("x", [1, 2], [0], [[1.0]])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="lacks"):
        load_cost_model(str(bad))
    with pytest.raises(ValueError, match="no cost profile"):
        load_cost_model("nonexistent-profile")

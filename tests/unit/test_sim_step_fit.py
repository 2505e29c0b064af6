"""The fitted step model: features, non-negative fit, modes, file format."""
import numpy as np
import pytest

from cluster.tools.sim.cost_model import Table2D, TableCostModel, TransferCost
from cluster.tools.sim.step_fit import TERMS, StepFeatures, StepFit, nnls
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledSeq, SchedulerOutput

COEF = (5e-4, 4e-5, 2e-5, 5e-6, 1e-8, 2e-8, 6e-7, 2e-7, 3e-4)


def _seq(rid, prompt_len, computed, n):
    r = Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=4))
    r.num_computed_tokens = computed
    if computed >= prompt_len:
        r.output_token_ids.append(1)
    return ScheduledSeq(r, n, [], True)


def test_features_mirror_the_attention_paths():
    fresh = StepFeatures.prefill([(100, 0)], 16)
    assert (fresh.fresh_attn, fresh.prefill_attn, fresh.prefill_kv) == (100 ** 2, 0, 0)
    cached = StepFeatures.prefill([(100, 40), (20, 300)], 16)      # padded batch: 2 x 100 x pad(320)
    assert cached.fresh_attn == 0 and cached.prefill_attn == 2 * 100 * 320 and cached.prefill_kv == 2 * 320
    sched = SchedulerOutput([_seq("a", 10, 10, 1), _seq("b", 40, 40, 1), _seq("c", 64, 0, 64)])
    f = StepFeatures.of(sched, 16)
    assert (f.prefill_seqs, f.decode_seqs, f.tokens, f.mixed) == (1, 2, 66, 1)
    assert f.decode_kv == 2 * 48                                      # longest decode context 41 -> 48


def test_nnls_recovers_nonnegative_coefficients():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (60, 5))
    x = np.array([1.0, 0.0, 2.0, 0.5, 0.0])
    got = nnls(a, a @ x)
    assert np.allclose(got, x, atol=1e-8)
    assert np.all(nnls(a, -(a @ x)) >= 0)                            # never negative


def test_fit_recovers_the_model_that_made_the_timings():
    true = StepFit(COEF, 16)
    shapes = [StepFeatures.prefill([(n, c)], 16) for n in (16, 64, 256) for c in (0, 128, 512)]
    shapes += [StepFeatures.decode(b, x, 16) for b in (1, 4, 16) for x in (64, 512, 2048)]
    shapes += [StepFeatures.prefill([(32, 0)] * k, 16) for k in (2, 4)]
    shapes += [StepFeatures.build([(64, 0)], [100] * b, 16) for b in (2, 8)]
    got = StepFit.fit(shapes, [true.seconds(f) for f in shapes], 16)
    for f in shapes:
        assert got.seconds(f) == pytest.approx(true.seconds(f), rel=1e-6)


def _profile(mode):
    fit = StepFit(COEF, 16)
    ns, cs, bs, xs = [16, 256], [0, 512], [1, 16], [64, 2048]
    pre = Table2D("prefill", ns, cs, [[fit.seconds(StepFeatures.prefill([(n, c)], 16)) * 1.1 for c in cs] for n in ns])
    dec = Table2D("decode", bs, xs, [[fit.seconds(StepFeatures.decode(b, x, 16)) for x in xs] for b in bs])
    return TableCostModel("m", pre, dec, COEF[0], TransferCost(1e-4, 1e-5, 1e9), 100, 10_000, fit=fit, fit_mode=mode)


def test_modes_and_json_round_trip():
    fitted, residual, table = _profile("fit"), _profile("fit+residual"), _profile("table")
    f = StepFit(COEF, 16)
    assert fitted.pure_prefill(16, 0) == pytest.approx(f.seconds(StepFeatures.prefill([(16, 0)], 16)))
    assert residual.pure_prefill(16, 0) == pytest.approx(table.pure_prefill(16, 0))   # exact at grid points
    assert table.fit is None and table.step_fit is not None
    again = TableCostModel.from_json(residual.to_json())
    assert again.fit_mode == "fit+residual" and again.step_fit == residual.step_fit
    assert again.pure_prefill(100, 100) == pytest.approx(residual.pure_prefill(100, 100))
    with pytest.raises(ValueError, match="fit mode"):
        residual.with_mode("spline")


def test_decode_run_matches_step_seconds_under_the_fit():
    m = _profile("fit")
    seqs = [_seq(f"r{i}", 100 + 7 * i, 100 + 7 * i, 1) for i in range(3)]
    ctx = [s.request.num_computed_tokens + 1 for s in seqs]
    run = m.decode_run(3, sum(ctx), 4, max(ctx))
    singles = []
    for _ in range(4):
        singles.append(m.step_seconds(SchedulerOutput(seqs)))
        for s in seqs:
            s.request.num_computed_tokens += 1
    assert np.allclose(run, singles)


def test_bad_fit_says_what_is_wrong():
    with pytest.raises(ValueError, match="coefficients"):
        StepFit((1.0,), 16)
    with pytest.raises(ValueError, match=">= 0"):
        StepFit((-1.0,) + COEF[1:], 16)
    with pytest.raises(ValueError, match="terms"):
        StepFit.from_json({"terms": ["step"], "coef": [1.0]})
    with pytest.raises(ValueError, match="at least"):
        StepFit.fit([StepFeatures()], [1.0], 16)
    assert len(TERMS) == len(COEF)


def test_scaled_cost_scales_steps_not_transfers():
    from cluster.tools.sim.cost_model import ScaledCost
    base = _profile("fit")
    s = ScaledCost(base, 1.5, 0.002)
    sched = SchedulerOutput([_seq("a", 64, 0, 64), _seq("b", 10, 10, 1)])
    assert s.step_seconds(sched) == pytest.approx(1.5 * base.step_seconds(sched) + 0.002)
    assert np.allclose(s.decode_run(2, 100, 3, 60), 1.5 * base.decode_run(2, 100, 3, 60) + 0.002)
    assert s.transfer_seconds(2, 10 ** 6) == base.transfer_seconds(2, 10 ** 6)
    with pytest.raises(ValueError, match="> 0"):
        ScaledCost(base, 0)

"""The simulator's token-level ITL histogram against numpy on the raw samples."""
import numpy as np
import pytest

from cluster.tools.sim.metrics import LogHistogram


def _samples(seed=3):
    rng = np.random.default_rng(seed)
    return [(rng.lognormal(-4, 0.6, size=int(rng.integers(1, 40))), int(rng.integers(1, 5))) for _ in range(400)]


@pytest.mark.parametrize("batch", [1, 7, 1 << 16])
def test_weighted_quantiles_and_mean_match_the_raw_samples(batch):
    """Each add(values, weight) counts every value ``weight`` times; percentiles land
    within one bin (~0.5%) of numpy's on the expanded samples, whatever the batching."""
    h = LogHistogram(batch=batch)
    raw = []
    for values, weight in _samples():
        h.add(values, weight=weight)
        raw.extend(np.repeat(values, weight))
    raw = np.asarray(raw)
    assert h.n == len(raw)
    assert h.mean() == pytest.approx(raw.mean(), rel=1e-12)
    for q in (0.5, 0.9, 0.99):
        assert h.quantile(q) == pytest.approx(np.quantile(raw, q), rel=0.01)


def test_scalars_and_reads_between_adds():
    h = LogHistogram(batch=1 << 16)
    assert h.mean() is None and h.quantile(0.5) is None
    h.add(0.01)
    assert h.n == 1 and h.mean() == pytest.approx(0.01)
    h.add(np.array([0.02, 0.03]), weight=2)          # read above, added after: both count
    assert h.n == 5 and h.mean() == pytest.approx((0.01 + 2 * 0.05) / 5)

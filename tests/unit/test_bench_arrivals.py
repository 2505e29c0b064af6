"""Arrival schedules: rates and burstiness, checked statistically on many samples."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cluster.tools.bench.arrivals import ArrivalSpec, schedule

N = 20000


def _gaps(spec, seed=0):
    offsets = schedule(spec, N, seed)
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    return np.diff(offsets)


def test_all_at_once():
    assert schedule(ArrivalSpec(math.inf), 5, 0) == [0.0] * 5
    assert schedule(ArrivalSpec(3.0), 0, 0) == []


def test_fixed_rate_is_evenly_spaced():
    assert schedule(ArrivalSpec(4.0, "fixed"), 5, 0) == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])


def test_poisson_mean_rate_and_exponential_spread():
    g = _gaps(ArrivalSpec(8.0))
    assert g.mean() == pytest.approx(1 / 8, rel=0.04)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)     # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_keeps_the_rate_and_burstiness_sets_the_spread(burstiness):
    g = _gaps(ArrivalSpec(5.0, "gamma", burstiness))
    assert g.mean() == pytest.approx(0.2, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_schedules_are_seeded():
    spec = ArrivalSpec(2.0)
    assert schedule(spec, 50, 7) == schedule(spec, 50, 7) != schedule(spec, 50, 8)


def test_from_flags_picks_gamma_for_burstiness():
    assert ArrivalSpec.from_flags(2.0, None, 0.5).process == "gamma"
    assert ArrivalSpec.from_flags(2.0, None, 1.0).process == "poisson"


@pytest.mark.parametrize("kwargs,match", [
    (dict(rate=0.0), "--request-rate"), (dict(rate=1.0, burstiness=0.0), "--burstiness"),
    (dict(rate=1.0, process="poisson", burstiness=0.5), "--arrival gamma"), (dict(rate=1.0, process="x"), "one of")])
def test_bad_specs_say_how_to_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArrivalSpec(**kwargs)

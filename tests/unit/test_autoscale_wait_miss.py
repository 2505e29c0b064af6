"""The TTFT wait-miss fraction (cluster/orchestration/autoscale/wait_miss.py): one definition,
which the live head (cluster/orchestration/autoscaler.py) measures from each request's first
token and the simulator (cluster/tools/sim/autoscale.py) from its records."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from cluster.config import ServeConfig
from cluster.observability.metrics import Metrics
from cluster.orchestration.autoscale import WaitMisses, prefill_alone_at_rate, wait_miss
from cluster.orchestration.autoscaler import Autoscaler, autoscale_config, wait_miss_window


def test_a_request_counts_only_when_its_prefill_alone_fits_the_target():
    assert wait_miss(ttft_s=0.9, prefill_alone_s=0.2, slo_ttft_s=1.0) == 0.0    # met
    assert wait_miss(ttft_s=1.0, prefill_alone_s=0.2, slo_ttft_s=1.0) == 0.0    # at the target: met
    assert wait_miss(ttft_s=1.3, prefill_alone_s=0.2, slo_ttft_s=1.0) == 1.0    # missed by waiting
    assert wait_miss(ttft_s=1.0, prefill_alone_s=1.0, slo_ttft_s=1.0) == 0.0    # just fits alone
    assert wait_miss(ttft_s=2.5, prefill_alone_s=1.2, slo_ttft_s=1.0) is None   # no worker could meet it
    assert prefill_alone_at_rate(1500, 1000.0) == 1.5 and prefill_alone_at_rate(0, 1000.0) == 0.0
    with pytest.raises(ValueError, match="slo-ttft-ms"):
        wait_miss(1.0, 0.1, 0.0)
    with pytest.raises(ValueError, match="tokens/s"):
        prefill_alone_at_rate(10, 0.0)


def test_the_window_keeps_the_counted_requests_of_its_span():
    w = WaitMisses(window_s=10.0)
    assert w.fraction(0.0) is None
    for t, ttft, alone in [(1.0, 0.5, 0.1), (2.0, 1.5, 0.3), (3.0, 4.0, 2.0), (4.0, 0.8, 0.8)]:
        w.add(t, ttft, alone, 1.0)
    assert w.fraction(5.0) == pytest.approx(1 / 3)     # the 2 s-alone prompt is not counted
    assert w.fraction(11.5) == pytest.approx(1 / 2)    # t=1 left the window
    assert w.fraction(14.5) is None


def _scaler(now: list[float], **config) -> tuple[Autoscaler, Metrics]:
    pool = SimpleNamespace(router=SimpleNamespace(view=SimpleNamespace(prefill=[], decode=[])),
                           serving=lambda pool: [f"{pool}-0"],
                           held=lambda pool: [f"{pool}-0"], stats={})
    metrics = Metrics()
    cfg = ServeConfig(autoscale=True, slo_ttft_ms=1000, autoscale_prefill_tokens_per_s=1000,
                      autoscale_interval=5.0, autoscale_cooldown_s=20.0, **config)
    return Autoscaler(SimpleNamespace(pool=pool), cfg, metrics, clock=lambda: now[0]), metrics


# a recorded series: (time of the first token, TTFT s, prompt tokens the prefill computed)
SERIES = [(1.0, 0.40, 200), (2.0, 1.60, 300), (3.0, 3.10, 2400), (4.0, 0.90, 900), (6.0, 1.20, 100),
          (14.0, 0.30, 100)]


def test_live_head_measures_the_wait_miss_fraction_from_first_tokens():
    """At 1000 prompt tokens/s a worker and a 1 s target: the 2400-token prompt (2.4 s alone) does
    not count; of the others in the window (10 s: half the cool-down), the 1.6 s and 1.2 s TTFTs
    missed by waiting. The controller gets the fraction, and the gauge shows it."""
    now = [0.0]
    scaler, metrics = _scaler(now, autoscale_ttft_miss_budget=0.01)
    assert wait_miss_window(scaler.config) == 10.0
    assert autoscale_config(scaler.config).ttft_miss_budget == 0.01
    seen = []
    for t, ttft, computed in SERIES:
        now[0] = t
        scaler.first_token(ttft, computed)
        if t in (6.0, 14.0):
            seen.append(scaler._signals(t).prefill.ttft_wait_miss_fraction)
            seen.append(metrics.registry.get_sample_value("pdserve_autoscale_ttft_wait_miss_fraction"))
    assert seen[:2] == [pytest.approx(2 / 4)] * 2                  # at 6 s: 1.6 and 1.2 missed of 4
    assert seen[2:] == [pytest.approx(1 / 3)] * 2                  # at 14 s: those of 4, 6 and 14 s
    now[0] = 30.0
    assert scaler._signals(30.0).prefill.ttft_wait_miss_fraction is None   # none in the last 10 s
    assert math.isnan(metrics.registry.get_sample_value("pdserve_autoscale_ttft_wait_miss_fraction"))


def test_without_a_budget_the_fraction_is_measured_but_the_p90_decides():
    now = [0.0]
    scaler, metrics = _scaler(now)
    for t, ttft, computed in SERIES[:5]:
        now[0] = t
        scaler.first_token(ttft, computed)
    assert scaler._signals(6.0).prefill.ttft_wait_miss_fraction is None
    assert metrics.registry.get_sample_value("pdserve_autoscale_ttft_wait_miss_fraction") == pytest.approx(0.5)
    assert autoscale_config(scaler.config).ttft_miss_budget == 0.002   # the controller's own default, unused


def test_the_miss_budget_is_a_part_of_the_requests():
    with pytest.raises(ValueError, match="autoscale_ttft_miss_budget"):
        ServeConfig(autoscale_ttft_miss_budget=1.5)

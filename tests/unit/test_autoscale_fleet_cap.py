"""The live head's fleet cap (`autoscale_max_total_workers`): the GPUs a fleet owns bound both
pools together; the controller then moves workers between the pools (the same rule the
simulator's `--max-total-workers` runs)."""
from __future__ import annotations

import pytest

from cluster.config import ServeConfig
from cluster.orchestration.autoscale import ControllerState, FleetSignals, decide
from cluster.orchestration.autoscale.signals import DecodeSignals, PrefillSignals
from cluster.orchestration.autoscaler import autoscale_config

BASE = dict(autoscale=True, prefill_workers=2, decode_workers=2, min_prefill_workers=1, max_prefill_workers=6,
            min_decode_workers=1, max_decode_workers=6, autoscale_prefill_tokens_per_s=1000)


def test_the_cap_reaches_the_controller_and_0_means_none():
    assert autoscale_config(ServeConfig(**BASE, autoscale_max_total_workers=5)).max_total_workers == 5
    assert autoscale_config(ServeConfig(**BASE)).max_total_workers is None


def test_both_pools_asking_for_more_stay_within_the_cap():
    cfg = autoscale_config(ServeConfig(**BASE, autoscale_max_total_workers=5))
    busy = FleetSignals(
        PrefillSignals(workers=2, ready_workers=2, queued_tokens=20_000, prompt_tokens_per_s=5_000,
                       ttft_p90_ms=9_000, tokens_per_s_per_worker=1000),
        DecodeSignals(workers=2, ready_workers=2, running=60, waiting=30, kv_usage=0.95, itl_p90_ms=50,
                      seqs_per_worker=16))
    uncapped, _ = decide(autoscale_config(ServeConfig(**BASE)), busy, ControllerState(), 0.0)
    capped, _ = decide(cfg, busy, ControllerState(), 0.0)
    assert uncapped.prefill.target + uncapped.decode.target > 5        # without the cap both grow past it
    assert capped.prefill.target + capped.decode.target == 5
    assert capped.prefill.target > 2 or capped.decode.target > 2


@pytest.mark.parametrize("bad, match", [
    (dict(autoscale_max_total_workers=-1), "no fleet cap"),
    (dict(autoscale_max_total_workers=3), "at least 4"),                        # below the start sizes 2 + 2
    (dict(autoscale_max_total_workers=4, min_prefill_workers=2, min_decode_workers=2, prefill_workers=2,
          decode_workers=2), None),                                           # exactly the start: fine
    (dict(autoscale_max_total_workers=8, colocated=True, prefill_workers=0), "colocated"),
])
def test_invalid_caps_say_how_to_fix(bad, match):
    kw = {**BASE, **bad}
    if match is None:
        assert ServeConfig(**kw).autoscale_max_total_workers == 4
        return
    with pytest.raises(ValueError, match=match):
        ServeConfig(**kw)


def test_without_autoscale_the_cap_is_only_checked_for_sign():
    assert ServeConfig(autoscale_max_total_workers=1).autoscale_max_total_workers == 1

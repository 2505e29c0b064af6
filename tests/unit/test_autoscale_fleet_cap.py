"""The live head's fleet cap (`autoscale_max_total_workers`): the GPUs a fleet owns bound both
pools together; the controller then moves workers between the pools (the same rule the
simulator's `--max-total-workers` runs)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cluster.config import ServeConfig
from cluster.observability.metrics import Metrics
from cluster.orchestration.autoscale import ControllerState, FleetSignals, decide
from cluster.orchestration.autoscale.controller import PoolDecision, Reason
from cluster.orchestration.autoscale.signals import DecodeSignals, PrefillSignals
from cluster.orchestration.autoscaler import Autoscaler, autoscale_config

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


def test_a_worker_decided_at_the_cap_starts_when_the_drained_one_has_left():
    """A trade at the cap drains a decode worker and grows prefill in one decision: the new prefill
    worker is created only once the drained one has left, so both pools never hold more than the cap
    (on a cluster with spare GPUs too), and the controller counts it as a prefill worker meanwhile."""
    held = {"prefill": ["p0", "p1"], "decode": ["d0", "d1"]}
    created: list[str] = []

    async def grow_pool(pool):
        created.append(pool)
        held[pool].append(f"{pool[0]}{len(held[pool])}")
        return held[pool][-1]

    async def retire_worker(worker_id, timeout=None):
        await left.wait()
        held["decode"].remove(worker_id)
        return True

    view = SimpleNamespace(prefill=[], decode=[SimpleNamespace(worker_id=w, load=SimpleNamespace(
        queued_prefill_tokens=0, running=i, waiting=0, kv_usage=0.1)) for i, w in enumerate(held["decode"])])
    pool = SimpleNamespace(router=SimpleNamespace(view=view), held=lambda p: list(held[p]),
                           serving=lambda p: list(held[p]), stats={})
    backend = SimpleNamespace(pool=pool, grow_pool=grow_pool, retire_worker=retire_worker)
    cfg = ServeConfig(**BASE, autoscale_max_total_workers=4, autoscale_interval=0.05)

    async def main():
        scaler = Autoscaler(backend, cfg, Metrics())
        scaler._act(PoolDecision("decode", 2, 1, Reason.TRADE, 1, 0.0))
        scaler._act(PoolDecision("prefill", 2, 3, Reason.LOAD, 3, 0.0))
        await asyncio.sleep(0.2)                       # several re-checks: the drained worker holds its GPU
        assert created == [] and scaler._workers("prefill") == 3 and scaler._gpus_in_use() == 4
        left.set()
        await asyncio.sleep(0.05)
        assert created == ["prefill"] and held == {"prefill": ["p0", "p1", "p2"], "decode": ["d1"]}
        assert scaler._workers("prefill") == 3 and scaler._gpus_in_use() == 4
        scaler.stop()

    left = asyncio.Event()
    asyncio.run(main())


def test_without_a_cap_a_new_worker_starts_at_once():
    held = {"prefill": ["p0"], "decode": ["d0"]}
    created: list[str] = []

    async def grow_pool(pool):
        created.append(pool)

    pool = SimpleNamespace(router=SimpleNamespace(view=SimpleNamespace(prefill=[], decode=[])),
                           held=lambda p: list(held[p]), serving=lambda p: list(held[p]), stats={})

    async def main():
        scaler = Autoscaler(SimpleNamespace(pool=pool, grow_pool=grow_pool), ServeConfig(**BASE), Metrics())
        scaler._act(PoolDecision("prefill", 1, 2, Reason.LOAD, 2, 0.0))
        await asyncio.sleep(0.01)
        assert created == ["prefill"]

    asyncio.run(main())

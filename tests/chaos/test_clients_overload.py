"""Fault 4: 100 clients (one connection each) that go away at random points:
before the first token, after k tokens, by their own deadline, by closing the
channel; some stay to the end. Nothing leaks and the server accounts for
every request it saw.

Fault 5: twice the configured capacity at once, from two tenants. Requests
past the bound get RESOURCE_EXHAUSTED with a retry-after-ms hint, the bound
is never exceeded, and clients that honour the hints all finish, the
smaller tenant included."""
from __future__ import annotations

import asyncio
import random

import pytest

from chaos_lib import check_outcomes, trials
from chaos_load import Outcome, draw_requests, run_load, stream_one
from cluster.cli.client import GenerationClient

pytestmark = pytest.mark.ray
OUTCOMES = ("finished", "cancelled", "deadline_exceeded", "unavailable", "internal", "resource_exhausted",
            "invalid_argument")
PLANS = ("complete", "after_k", "cancel_early", "deadline", "close_channel")


async def _client(target: str, req, plan: str, rng: random.Random) -> Outcome:
    client = GenerationClient(target)
    try:
        if plan == "complete":
            return await stream_one(client, req, timeout=240)
        if plan == "after_k":
            k = rng.randrange(1, req.max_tokens)
            return await stream_one(client, req, timeout=240, on_chunk=lambda r, n: n >= k)
        if plan == "deadline":
            return await stream_one(client, req, timeout=rng.uniform(0.05, 2.0))
        out = Outcome(req.rid)
        task = asyncio.create_task(stream_one(client, req, timeout=240, out=out))
        await asyncio.sleep(rng.uniform(0.0, 1.5))
        if plan == "cancel_early":
            task.cancel()
        else:
            await client.close()
        try:
            await task
        except asyncio.CancelledError:
            out.code = out.code or "CANCELLED_BY_CLIENT"
        return out
    finally:
        await client.close()


def run_disconnects(c, hf, report, n_trials: int, n_clients: int, seed: int) -> None:
    rng = random.Random(seed)
    for t in range(n_trials):
        c.settle()
        reqs, refs = draw_requests(rng, hf, n_clients, f"dc{seed}-{t}", max_tokens=32)
        plans = {r.rid: rng.choice(PLANS) for r in reqs}
        seen0 = {o: c.sample("pdserve_requests_total", outcome=o) for o in OUTCOMES}

        async def go():
            return await asyncio.gather(*[_client(c.target, r, plans[r.rid], random.Random(rng.random()))
                                          for r in reqs])

        outs = {o.rid: o for o in asyncio.run(go())}
        errors = check_outcomes(outs, refs, allowed={"CANCELLED_BY_CLIENT", "CANCELLED", "DEADLINE_EXCEEDED"},
                                explain=c.explain)
        assert all(outs[rid].finished for rid, p in plans.items() if p == "complete")
        leaked = c.settle()
        seen = {o: c.sample("pdserve_requests_total", outcome=o) - seen0[o] for o in OUTCOMES}
        started = sum(1 for o in outs.values() if o.tokens)
        assert seen["internal"] == seen["unavailable"] == seen["invalid_argument"] == 0, seen
        assert started <= sum(seen.values()) <= n_clients, (started, seen)
        assert seen["finished"] >= sum(o.finished for o in outs.values() if plans[o.rid] == "complete")
        report.add("4 clients disconnect", outs, errors=errors, leaked=leaked,
                   **{f"plan_{p}": sum(1 for v in plans.values() if v == p) for p in PLANS})


def run_overload(c, hf, report, n_trials: int, capacity: int, seed: int) -> None:
    rng = random.Random(seed)
    adm = c.admission
    old_max, real_on_change, peak = adm.max_requests, adm._on_change, [0]

    def on_change(n: int) -> None:
        peak[0] = max(peak[0], n)
        real_on_change(n)

    adm.max_requests, adm._on_change = capacity, on_change
    try:
        for t in range(n_trials):
            c.settle()
            peak[0] = 0
            big, refs = draw_requests(rng, hf, capacity * 3 // 2, f"ovA{seed}-{t}", max_tokens=24,
                                      salts=("alpha/1", "alpha/2"))
            small, refs_small = draw_requests(rng, hf, capacity // 2, f"ovB{seed}-{t}", max_tokens=24,
                                              salts=("beta/1",))
            reqs = big + small
            refs.merge(refs_small)
            outs = asyncio.run(run_load(c.target, reqs, retries=500))
            errors = check_outcomes(outs, refs, allowed=set(), explain=c.explain)
            refusals = sum(o.refusals for o in outs.values())
            assert refusals >= 1, "2x the capacity at once must be refused in part"
            assert all(h > 0 for o in outs.values() for h in o.hints_ms), "every refusal carries retry-after-ms"
            assert peak[0] <= capacity, f"{peak[0]} requests admitted at once, capacity {capacity}"
            leaked = c.settle()
            report.add("5 overload 2x capacity", outs, errors=errors, leaked=leaked, refusals=refusals,
                       refusals_small_tenant=sum(outs[r.rid].refusals for r in small))
    finally:
        adm.max_requests, adm._on_change = old_max, real_on_change


def test_clients_disconnect_fast(chaos_cluster, hf_model, chaos_report):
    run_disconnects(chaos_cluster, hf_model, chaos_report, trials(2, 20, False), 100, seed=4)


def test_overload_fast(chaos_cluster, hf_model, chaos_report):
    run_overload(chaos_cluster, hf_model, chaos_report, trials(2, 20, False), 8, seed=5)


@pytest.mark.chaos_full
@pytest.mark.timeout(7200)
def test_clients_disconnect_full(chaos_cluster, hf_model, chaos_report):
    run_disconnects(chaos_cluster, hf_model, chaos_report, trials(2, 20, True), 100, seed=404)


@pytest.mark.chaos_full
@pytest.mark.timeout(7200)
def test_overload_full(chaos_cluster, hf_model, chaos_report):
    run_overload(chaos_cluster, hf_model, chaos_report, trials(2, 20, True), 16, seed=505)

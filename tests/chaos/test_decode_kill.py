"""Fault 1: a decode worker is killed (ray.kill, Ray restarts it) at a random
moment while requests stream through it. Its requests migrate: every request
finishes with exactly the tokens of an undisturbed greedy run."""
from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
import ray

from chaos_lib import check_leases, check_outcomes, trials
from chaos_load import TokenCount, draw_requests, run_load

pytestmark = pytest.mark.ray


def run_decode_kill(c, hf, report, n_trials: int, n_requests: int, seed: int) -> None:
    rng = random.Random(seed)
    for t in range(n_trials):
        c.settle()
        reqs, refs = draw_requests(rng, hf, n_requests, f"dk{seed}-{t}", max_tokens=32)
        before, leases0 = c.counters(), c.lease_counters()
        metric0 = c.sample("pdserve_request_migrations_total")
        threshold = rng.uniform(0.05, 0.6) * sum(r.max_tokens for r in reqs)
        streamed, killed = TokenCount(), {}

        async def fault():
            while streamed.total < threshold:
                await asyncio.sleep(0.01)
            by_worker = await c.on_loop(lambda: Counter(
                st.decode_id for st in c.backend.in_flight.values() if st.decode_id))
            victim = max(c.pool("decode"), key=lambda w: (by_worker[w], rng.random()))
            killed.update(victim=victim, in_flight=by_worker[victim])
            ray.kill(c.backend.workers[victim].actor, no_restart=False)

        outs = asyncio.run(run_load(c.target, reqs, on_chunk=streamed, during=fault))
        errors = check_outcomes(outs, refs, allowed=set(), explain=c.explain)
        assert killed, "the fault never fired"
        leaked = c.settle()
        after = c.counters()
        migrated = after["migrations"] - before["migrations"]
        assert migrated == c.sample("pdserve_request_migrations_total") - metric0
        events = [(rid, k) for rid, k in c.events() if k == "migrations" and rid.startswith(f"dk{seed}-{t}-")]
        assert len(events) == migrated, "every migration is accounted to a request"
        assert migrated >= 1 or killed["in_flight"] == 0, f"{killed} but nothing migrated"
        assert all(outs[rid].finished for rid, _ in events), "migrated requests must finish"
        leases = check_leases(leases0, c.lease_counters())
        assert leases["expired"] == 0, f"no decode side vanished unseen, yet leases expired: {leases}"
        report.add("1 kill decode worker", outs, errors=errors, leaked=leaked, migrated=migrated,
                   recomputed=after["recomputed"] - before["recomputed"],
                   in_flight_on_victim=killed["in_flight"])


def test_kill_decode_worker_fast(chaos_cluster, hf_model, chaos_report):
    run_decode_kill(chaos_cluster, hf_model, chaos_report, trials(2, 20, False), 24, seed=1)


@pytest.mark.chaos_full
@pytest.mark.timeout(7200)
def test_kill_decode_worker_full(chaos_cluster, hf_model, chaos_report):
    run_decode_kill(chaos_cluster, hf_model, chaos_report, trials(2, 20, True), 64, seed=101)

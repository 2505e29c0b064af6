"""`pdserve serve --autoscale` on a local Ray cluster (cluster/orchestration/autoscaler.py):
the bench harness sends load one worker of a pool cannot hold (decode: streams long enough, at
the speed measured on the cluster just before, to keep three workers' sequences busy; prefill:
prompt tokens/s over the capacity the controller is given), the pool grows within its bound; the load stops, the pool shrinks back to its minimum. Every request finishes with
the tokens of an undisturbed greedy run, and no KV block or lease is left behind. The decode
backlog queued on the first worker moves to free slots on the workers added under it
(orchestration/rebalance.py).

Bounds stated: with a decision every 0.5 s and a 3 s cool-down, a pool grows within 20 s
of the load starting and is back at its minimum within 60 s of the load ending."""
from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest

from cluster.cli.client import GenerationClient
from cluster.config import ServeConfig
from cluster.tools.bench.arrivals import ArrivalSpec, schedule
from cluster.tools.bench.datasets import BenchRequest
from cluster.tools.bench.runner import RequestResult, RunnerConfig, run_load
from cluster_harness import Cluster, free_port
from tiny_models import hf_greedy, load_hf_model

pytestmark = pytest.mark.ray
GROW_WITHIN_S, SHRINK_WITHIN_S = 20.0, 60.0


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    cfg = ServeConfig(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=1024, grpc_port=free_port(), http_port=0,
                      metrics_port=0, prefill_workers=1, decode_workers=1, cpus_per_worker=0.25,
                      local_prefill_threshold=0, max_num_seqs=4, autoscale=True, autoscale_interval=0.5,
                      autoscale_cooldown_s=3.0, max_prefill_workers=2, max_decode_workers=3,
                      slo_ttft_ms=60_000, slo_itl_ms=60_000,   # sized by capacity here, not latency
                      autoscale_prefill_tokens_per_s=1500, autoscale_decode_seqs_per_worker=4,
                      autoscale_ttft_miss_budget=0.01,   # the wait-miss fraction decides prefill's SLO
                      autoscale_max_total_workers=4,     # a fleet cap under the pools' maxima together (5)
                      ray_temp_dir=str(tmp_path_factory.mktemp("ray")))
    c = Cluster(cfg)
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf_model(tiny_llama_dir)


class RecordingSender:
    """The bench harness's Sender, keeping each request's tokens to compare."""

    def __init__(self, target: str) -> None:
        self.client = GenerationClient(target)
        self.tokens: dict[int, list[int]] = {}

    async def send(self, req: BenchRequest, request_id: str, res: RequestResult, loop, start: float) -> None:
        index = int(request_id.rsplit("-", 1)[1])
        out: list[int] = []
        sent = loop.time()
        async for r in self.client.generate(prompt_token_ids=list(req.prompt_token_ids), max_tokens=req.output_len,
                                            temperature=0.0, ignore_eos=True, request_id=request_id):
            if r.token_ids and res.ttft_s is None:
                res.ttft_s = loop.time() - sent
            out += list(r.token_ids)
        res.output_tokens, res.e2e_s = len(out), loop.time() - sent
        self.tokens[index] = out

    async def close(self) -> None:
        await self.client.close()


def decisions(cluster: Cluster) -> list:
    async def get():
        return [(d.prefill.target, d.prefill.reason.value, round(d.prefill.predicted_load),
                 d.decode.target, d.decode.reason.value, round(d.decode.predicted_load))
                for d in cluster.backend.autoscaler.decisions[-30:]]
    return cluster.loop.run(get())


class PoolWatch:
    """Samples a pool's serving size from the frontend's loop, and each of the controller's
    intervals (what it saw and decided): recorded here, as the controller keeps only its last 100
    (50 s), which a slow machine's load and drain outlast."""

    def __init__(self, cluster: Cluster, pool: str) -> None:
        self.cluster, self.pool, self.sizes = cluster, pool, []
        self.intervals: dict[int, tuple] = {}     # id of the interval's signals -> (its signals, its decision)
        self._before = self._sample()[1]          # intervals decided before the watch: not this run's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def size(self) -> int:
        async def serving():
            return len(self.cluster.backend.pool.serving(self.pool))
        return self.cluster.loop.run(serving())

    def _sample(self) -> tuple[int, list[tuple]]:
        async def get():
            a = self.cluster.backend.autoscaler
            return len(self.cluster.backend.pool.serving(self.pool)), list(zip(a.signals, a.decisions))
        return self.cluster.loop.run(get())

    def _run(self) -> None:
        while not self._stop.is_set():
            size, intervals = self._sample()
            self.sizes.append((time.monotonic(), size))
            # the objects are kept (here and in _before), so no id is reused for a later interval
            old = {id(s) for s, _ in self._before}
            self.intervals.update((id(s), (s, d)) for s, d in intervals if id(s) not in old)
            time.sleep(0.25)

    def wait_misses(self) -> list[float]:
        """The wait-miss fraction (the part of the window's first tokens that missed TTFT by
        waiting) of each interval that had first tokens in its window."""
        return [s.prefill.ttft_wait_miss_fraction for s, _ in self.intervals.values()
                if s.prefill.ttft_wait_miss_fraction is not None]

    def fleet_peak(self) -> int:
        """The most workers the fleet held: targets of both pools plus draining workers."""
        return max(d.prefill.target + d.decode.target + s.draining for s, d in self.intervals.values())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def drive(cluster: Cluster, requests: list[BenchRequest], rate: float) -> RecordingSender:
    offsets = schedule(ArrivalSpec(rate=rate), len(requests), seed=0)

    async def go():
        sender = RecordingSender(cluster.target)   # its channel belongs to this loop
        try:
            run = await run_load(sender, requests, offsets, RunnerConfig(progress=False, drain_timeout_s=240))
        finally:
            await sender.close()
        return sender, run
    sender, run = asyncio.run(go())
    assert all(r.ok for r in run.results), [r.error for r in run.results if not r.ok]
    return sender


def requests_of(n: int, distinct: int, prompt_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """n requests cycling over `distinct` random prompts."""
    rng = np.random.default_rng(seed)
    prompts = [tuple(int(t) for t in rng.integers(3, 250, prompt_len)) for _ in range(distinct)]
    return [BenchRequest(prompts[i % distinct], output_len, prompt_len=prompt_len) for i in range(n)]


def seconds_per_token(cluster: Cluster, output_len: int = 64) -> float:
    """One stream's decode time per token on this cluster, now (the host's speed drifts)."""
    async def go() -> float:
        async with GenerationClient(cluster.target) as c:
            first, n = None, 0
            async for r in c.generate(prompt_token_ids=list(range(3, 27)), max_tokens=output_len,
                                      temperature=0.0, ignore_eos=True):
                if r.token_ids and first is None:
                    first = time.monotonic()
                n += len(r.token_ids)
            assert first is not None and n == output_len
            return (time.monotonic() - first) / (n - 1)
    return asyncio.run(go())


def streams_one_worker_cannot_hold(cluster: Cluster, rate: float) -> int:
    """An output length at which `rate` streams a second keep three decode workers' sequences
    (3 x max_num_seqs) busy, by the stream speed measured now: a load one worker cannot hold on a
    fast host as on a slow one (a fixed length was held by one worker on a quiet host)."""
    spt = seconds_per_token(cluster)
    want = 3 * cluster.backend.config.max_num_seqs
    return int(min(512, max(32, math.ceil(want / (rate * spt)))))


@pytest.mark.parametrize("pool, n, distinct, prompt_len, output_len, rate", [
    ("decode", 120, 8, 24, None, 12.0),   # 10 s of 12 streams/s, long enough to need 3 workers' sequences
    ("prefill", 150, 150, 480, 2, 10.0),  # 15 s of 10 x 480 prompt tokens/s against 1500 per worker
])
def test_pool_grows_under_load_and_shrinks_back(cluster, hf, pool, n, distinct, prompt_len, output_len, rate):
    low, high = cluster.backend.config.pool_bounds(pool)
    output_len = output_len or streams_one_worker_cannot_hold(cluster, rate)
    watch = PoolWatch(cluster, pool)
    try:
        start = time.monotonic()
        requests = requests_of(n, distinct, prompt_len, output_len, seed=len(pool))
        sender = drive(cluster, requests, rate)
        # every first token reached the live head's wait-miss fraction: measured while the load
        # ran, and 0 (a 60 s target: none missed)
        misses = watch.wait_misses()
        assert misses and set(misses) == {0.0}, misses
        while not any(s > low for _, s in watch.sizes) and time.monotonic() < start + GROW_WITHIN_S:
            time.sleep(0.25)
        end = time.monotonic() + SHRINK_WITHIN_S
        while watch.size() > low:
            assert time.monotonic() < end, f"{pool} pool still {watch.size()} workers {SHRINK_WITHIN_S} s after the load"
            time.sleep(0.25)
    finally:
        watch.stop()
    grown = [(t, s) for t, s in watch.sizes if s > low]
    assert grown, (f"the {pool} pool never grew under {n} requests of {prompt_len} + {output_len} tokens at "
                   f"{rate}/s: {watch.sizes[::8]}; decisions {decisions(cluster)}")
    assert grown[0][0] - start <= GROW_WITHIN_S
    assert max(s for _, s in watch.sizes) <= high
    expected: dict[tuple[int, ...], list[int]] = {}
    for i, req in enumerate(requests):
        ids = req.prompt_token_ids
        if ids not in expected:
            expected[ids] = hf_greedy(hf, list(ids), output_len)
        assert sender.tokens[i] == expected[ids], f"request {i}"
    cluster.wait_idle()
    ups = cluster.sample("pdserve_autoscale_decisions_total", pool=pool, direction="up", reason="load") + \
        cluster.sample("pdserve_autoscale_decisions_total", pool=pool, direction="up", reason="kv_room") + \
        cluster.sample("pdserve_autoscale_decisions_total", pool=pool, direction="up", reason="queue")
    downs = cluster.sample("pdserve_autoscale_decisions_total", pool=pool, direction="down", reason="idle")
    assert ups >= 1 and downs >= 1
    if pool == "decode":   # the backlog queued on the first worker moved to free slots on the added ones
        assert cluster.sample("pdserve_decode_rebalanced_total") > 0
    assert cluster.sample("pdserve_pool_target_workers", pool=pool) == low
    assert cluster.backend.autoscaler.controller.max_total_workers == 4
    assert watch.fleet_peak() <= 4      # the cap held, in every interval of the run

"""benchmarks/routing.py: the arms it runs, and the service floor's one-at-a-time sends against a
real in-process gRPC server through the real load runner."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import grpc
import pytest

from bench_scripts import BENCH, load_bench_script
from cluster.pb import generation_pb2 as pb
from cluster.pb import generation_pb2_grpc as pb_grpc
from cluster.tools.bench.datasets import BenchRequest
from cluster.tools.bench.runner import RunnerConfig, run_load


@pytest.fixture(scope="module")
def rb():
    sys.path.insert(0, str(BENCH))            # it imports its siblings (routing_workloads, process_cpu, ...)
    try:
        return load_bench_script("routing")
    finally:
        sys.path.remove(str(BENCH))


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"floor_arm": False, "prefill_queue_limit": -1, "gated_arm_limit": -1,
                                 "min_hit_share_arm": -1.0, **kw})


def test_the_floor_arm_runs_first_prefix_aware_and_one_at_a_time(rb):
    assert list(rb.arms(_args())) == ["prefix_aware", "round_robin"]
    a = rb.arms(_args(floor_arm=True, gated_arm_limit=0, prefill_queue_limit=512))
    assert list(a) == ["service_floor", "prefix_aware", "prefix_aware_gated", "round_robin"]
    assert a["service_floor"] == rb.Arm("prefix_aware", -1, one_at_a_time=True)
    assert a["prefix_aware"] == rb.Arm("prefix_aware", 512) and a["prefix_aware_gated"].gate == 0
    assert not any(x.one_at_a_time for k, x in a.items() if k != "service_floor")
    assert all(x.min_hit_share is None for x in a.values())             # --min-hit-share's, for every arm


def test_the_min_hit_share_arm_follows_prefix_aware_with_its_own_share(rb):
    a = rb.arms(_args(min_hit_share_arm=0.2, prefill_queue_limit=512))
    assert list(a) == ["prefix_aware", "prefix_aware_min_hit", "round_robin"]
    assert a["prefix_aware_min_hit"] == rb.Arm("prefix_aware", 512, min_hit_share=0.2)
    assert list(rb.arms(_args(min_hit_share_arm=0.0))) == ["prefix_aware", "prefix_aware_min_hit", "round_robin"]


def test_send_plans(rb):
    assert rb.send_plan([0.0, 1.5, 4.0], rb.Arm("round_robin", -1)) == ([0.0, 1.5, 4.0], 0)
    assert rb.send_plan([0.0, 1.5, 4.0], rb.Arm("prefix_aware", -1, True)) == ([0.0, 0.0, 0.0], 1)


def test_ttft_ratio(rb):
    num = {"ttft_ms": {"p50": 30.0, "p90": 90.0, "mean": 0.0}}
    den = {"ttft_ms": {"p50": 10.0, "p90": 30.0, "mean": 5.0}}
    assert rb.ttft_ratio(num, den) == {"p50": 3.0, "p90": 3.0, "mean": None}


class Timed(pb_grpc.GenerationServicer):
    """Answers after 30 ms and records each request's (id, start, end)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []

    async def Generate(self, request, context):
        t0 = time.monotonic()
        await asyncio.sleep(0.03)
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[7], finish_reason="length",
                                  usage=pb.Usage(prompt_tokens=4, completion_tokens=1))
        self.spans.append((request.request_id, t0, time.monotonic()))


def test_the_floor_plan_sends_each_request_in_order_after_the_one_before_finished(rb):
    servicer = Timed()
    reqs = [BenchRequest((i + 1, 2, 3, 4), 1, prompt_len=4) for i in range(5)]
    sends, cap = rb.send_plan([0.0, 0.0, 0.01, 0.02, 0.02], rb.Arm("prefix_aware", -1, True))

    async def go():
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await run_load(f"127.0.0.1:{port}", reqs, sends,
                                  RunnerConfig(progress=False, max_concurrency=cap), tag="f")
        finally:
            await server.stop(0)

    run = asyncio.run(go())
    assert all(r.ok for r in run.results)
    assert [s[0] for s in servicer.spans] == [f"bench-f-{i}" for i in range(5)]
    assert all(nxt[1] >= prev[2] for prev, nxt in zip(servicer.spans, servicer.spans[1:]))   # no overlap
    assert all(r.ttft_s < 0.5 for r in run.results)          # timed from its own send, not from the run's start

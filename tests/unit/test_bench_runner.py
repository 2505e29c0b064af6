"""The open-loop runner against a scripted in-process gRPC server (no engine):
token timing, error codes, the concurrency cap, the duration bound, the drain timeout."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.tools.bench.datasets import BenchRequest
from cluster.tools.bench.runner import INCOMPLETE, RunnerConfig, run_load
from cluster.pb import generation_pb2 as pb
from cluster.pb import generation_pb2_grpc as pb_grpc

FAIL, HANG, CHUNKY = 1, 2, 3     # first prompt token selects the script


class ScriptedServer(pb_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.running = 0
        self.max_running = 0
        self.request_ids: list[str] = []

    async def Generate(self, request, context):
        ids = list(request.prompt_token_ids.ids)
        self.request_ids.append(request.request_id)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if ids[0] == FAIL:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker")
            if ids[0] == HANG:
                await asyncio.sleep(60)
            n = request.sampling.max_tokens
            sizes = [1, 3] if ids[0] == CHUNKY else [1] * n
            for j, k in enumerate(sizes):
                await asyncio.sleep(0.02)
                last = j == len(sizes) - 1
                yield pb.GenerateResponse(
                    request_id=request.request_id, token_ids=[7] * k, finish_reason="length" if last else "",
                    usage=pb.Usage(prompt_tokens=len(ids), completion_tokens=sum(sizes[:j + 1]), cached_tokens=3)
                    if last else None)
        finally:
            self.running -= 1


async def _serve(servicer):
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _run(reqs, offsets, cfg=RunnerConfig(progress=False)):
    servicer = ScriptedServer()

    async def go():
        server, target = await _serve(servicer)
        try:
            return await run_load(target, reqs, offsets, cfg, tag="t")
        finally:
            await server.stop(0)
    return asyncio.run(go()), servicer


def _req(first, out=4, n=6):
    return BenchRequest((first,) + (9,) * (n - 1), out, prompt_len=n)


def test_tokens_are_timed_and_usage_read():
    run, srv = _run([_req(9), _req(9, out=2)], [0.0, 0.0])
    a, b = run.results
    assert sorted(srv.request_ids) == ["bench-t-0", "bench-t-1"]
    assert a.ok and a.output_tokens == 4 and a.cached_tokens == 3 and a.prompt_tokens == 6
    assert len(a.itl_s) == 3 and len(a.token_times_s) == 4 and all(g > 0 for g in a.itl_s)
    assert 0 < a.ttft_s < a.e2e_s and a.tpot_s is not None
    assert b.output_tokens == 2 and len(b.itl_s) == 1
    assert run.elapsed_s >= a.e2e_s


def test_a_chunk_of_k_tokens_gives_k_equal_gaps():
    run, _ = _run([_req(CHUNKY)], [0.0])
    r = run.results[0]
    assert r.output_tokens == 4 and len(r.itl_s) == 3 and len(set(r.itl_s)) == 1


def test_failures_keep_their_grpc_code():
    run, _ = _run([_req(FAIL), _req(9)], [0.0, 0.0])
    assert run.results[0].error_code == "UNAVAILABLE" and run.results[0].error == "no worker"
    assert run.results[1].ok


def test_concurrency_cap_holds_requests_and_reports_the_wait():
    run, srv = _run([_req(9) for _ in range(6)], [0.0] * 6, RunnerConfig(max_concurrency=2, progress=False))
    assert srv.max_running == 2
    assert all(r.ok for r in run.results)
    assert sum(1 for r in run.results if r.cap_wait_s > 0.02) >= 4   # each request takes >= 4 x 20 ms


def test_duration_stops_sending():
    run, srv = _run([_req(9), _req(9), _req(9), _req(9)], [0.0, 0.0, 50.0, 60.0],
                    RunnerConfig(duration_s=0.5, progress=False))
    assert len(run.results) == 2 and run.not_sent == 2 and len(srv.request_ids) == 2


def test_drain_timeout_cancels_what_still_runs():
    run, _ = _run([_req(HANG), _req(9)], [0.0, 0.0], RunnerConfig(drain_timeout_s=0.5, progress=False))
    assert run.results[0].error_code == INCOMPLETE
    assert run.results[1].ok


def test_config_validation():
    with pytest.raises(ValueError, match="--max-concurrency"):
        RunnerConfig(max_concurrency=-1)
    with pytest.raises(ValueError, match="send times"):
        asyncio.run(run_load("127.0.0.1:1", [_req(9)], [], RunnerConfig(progress=False)))

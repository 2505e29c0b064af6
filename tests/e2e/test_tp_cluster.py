"""Tensor-parallel workers in a real cluster (local Ray, gRPC on loopback, tcp KV hand-off):
prefill TP 2 -> decode TP 1 and 1 -> 2 on a tiny Llama with 2 KV heads, 2 -> 2 on a tiny Qwen2 with
the same KV layout, and all three on a Llama with 1 KV head (replicated on both ranks of a TP 2 worker); each decode rank reads exactly its KV heads from the prefill ranks that hold them.
Greedy tokens equal transformers `generate`; the bytes moved are the model's KV once per
replica; the prefill node's leases all end (every rank's read done, then rank 0 notified);
and a rank that dies (of a decode or a prefill worker) takes its worker down, which comes
back and serves again."""
from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from cluster.cli.client import GenerationClient
from cluster.config import ServeConfig
from cluster_harness import Cluster, free_port
from kvtransfer.registry import available_backends
from tiny_models import hf_greedy, load_hf_model, make_tiny_model

pytestmark = pytest.mark.ray
BS, MAX_NEW = 16, 8
TILE = BS * 16 * 4                        # one KV head's block tile: 16 tokens x head_dim 16 x fp32
LAYERS = 3
MODELS = {"llama": ("tiny_llama_dir", 2), "qwen2": ("tiny_qwen2_dir", 2), "llama-1kv": ("tiny_llama_1kv_dir", 1)}


@pytest.fixture(scope="module")
def tiny_llama_1kv_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama_1kv"), "llama", num_kv_heads=1, seed=3)


def _config(model_dir, tmp, prefill_tp: int, decode_tp: int, backend: str = "tcp", decode_workers: int = 1) -> ServeConfig:
    return ServeConfig(
        model=str(model_dir), num_kv_blocks=32, max_model_len=256, block_size=BS, transfer_backend=backend,
        prefill_tensor_parallel_size=prefill_tp, decode_tensor_parallel_size=decode_tp,
        grpc_port=free_port(), http_port=0, metrics_port=0, prefill_workers=1, decode_workers=decode_workers,
        ray_temp_dir=str(tmp), worker_niceness=0, local_prefill_threshold=0, local_prefill_hit_ratio=1.0,
        reserve_decode_blocks=True, pipelined_handoff=True, max_num_batched_tokens=40)


@pytest.fixture(scope="module", autouse=True)
def ray_runtime(tiny_llama_dir, tmp_path_factory):
    """One local Ray for the module's clusters, sized for the largest (TP 2 prefill, two TP 2
    decode workers); each cluster starts and stops its own workers on it, as deployments sharing
    a Ray cluster (`--address`) do."""
    import ray

    from cluster.orchestration.launcher import init_ray
    init_ray(_config(tiny_llama_dir, tmp_path_factory.mktemp("ray"), 2, 2, decode_workers=2))
    yield
    ray.shutdown()


def _cluster(model_dir, tmp, prefill_tp: int, decode_tp: int, backend: str = "tcp", decode_workers: int = 1) -> Cluster:
    return Cluster(_config(model_dir, tmp, prefill_tp, decode_tp, backend, decode_workers), keep_ray=True)


async def _complete(target, ids):
    async with GenerationClient(target) as c:
        return await c.complete(prompt_token_ids=ids, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 2 * BS, 3 * BS + 9, 5 * BS + 1)]


def _serve_and_compare(cluster: Cluster, model_dir, kv_heads: int, decode_tp: int) -> None:
    hf = load_hf_model(model_dir)
    prompts = _prompts()
    blocks0 = cluster.sample("pdserve_kv_transfer_blocks_total")
    bytes0 = cluster.sample("pdserve_kv_transfer_bytes_sum")
    admits0 = cluster.sample("pdserve_handoff_seconds_count", stage="admit")
    for p in prompts:
        got = asyncio.run(_complete(cluster.target, p))
        assert got.tokens == hf_greedy(hf, p, MAX_NEW), f"prompt of {len(p)} tokens"
    blocks = cluster.sample("pdserve_kv_transfer_blocks_total") - blocks0
    moved = cluster.sample("pdserve_kv_transfer_bytes_sum") - bytes0
    assert blocks == sum(-(-len(p) // BS) for p in prompts)
    assert cluster.sample("pdserve_handoff_seconds_count", stage="admit") - admits0 == len(prompts), \
        "the decode worker (rank 0's engine) announces every hand-off's admission"
    replicas = max(1, decode_tp // kv_heads)     # decode ranks beyond the KV heads each read their replica
    assert moved == blocks * 2 * LAYERS * kv_heads * TILE * replicas, "every rank's heads of every block, once"
    cluster.wait_idle()                   # leases all ended: every decode rank read, then rank 0 notified


# every mix: 2 KV heads split (2 -> 1 and 1 -> 2 on the Llama, 2 -> 2 on Qwen2, whose hand-off has the
# Llama's KV layout: one 2 -> 2 run covers both; its sharded projections' biases: test_tensor_parallel.py)
# and 1 KV head replicated on every rank (the Llama, all three mixes)
@pytest.mark.parametrize("model,prefill_tp,decode_tp", [("llama", 2, 1), ("llama", 1, 2), ("qwen2", 2, 2),
                                                        ("llama-1kv", 1, 2), ("llama-1kv", 2, 1),
                                                        ("llama-1kv", 2, 2)])
def test_tp_mix_hands_off_and_matches_transformers(request, tmp_path_factory, model, prefill_tp, decode_tp):
    fixture, kv_heads = MODELS[model]
    model_dir = request.getfixturevalue(fixture)
    cluster = _cluster(model_dir, tmp_path_factory.mktemp("ray"), prefill_tp, decode_tp)
    try:
        infos = {w: cluster.call(w, "ready") for w in cluster.backend.workers}
        assert infos["prefill-0"].tensor_parallel_size == prefill_tp
        assert infos["decode-0"].tensor_parallel_size == decode_tp
        _serve_and_compare(cluster, model_dir, kv_heads, decode_tp)
        if (model, decode_tp) == ("llama", 2) and prefill_tp == 1:
            _a_dead_rank_takes_its_worker_down(cluster, model_dir, "decode-0")
        if (model, prefill_tp, decode_tp) == ("llama", 2, 1):
            _a_dead_rank_takes_its_worker_down(cluster, model_dir, "prefill-0")
    finally:
        cluster.close()


@pytest.mark.skipif("nixl" not in available_backends(), reason="nixl not installed")
def test_tp_hand_off_over_nixl(tiny_llama_dir, tmp_path_factory):
    """The default backend: prefill ranks 1..N-1 are one-sided NIXL sources (their actors
    progress the passive side), the decode rank reads head ranges with NIXL descriptors."""
    cluster = _cluster(tiny_llama_dir, tmp_path_factory.mktemp("ray"), 2, 1, backend="nixl")
    try:
        assert cluster.call("decode-0", "ready").backend == "nixl"
        _serve_and_compare(cluster, tiny_llama_dir, 2, 1)
    finally:
        cluster.close()


def _a_dead_rank_takes_its_worker_down(cluster: Cluster, model_dir, worker: str) -> None:
    """Kill ``worker``'s rank 1: rank 0 exits too, Ray restarts both, the pool marks the worker
    dead and routes to it again once it is back; it then serves tokens equal to transformers."""
    import ray

    ref = cluster.backend.workers[worker]
    pid = cluster.call(worker, "ready").pid
    ray.kill(ref.placement.ranks[0], no_restart=False)
    deadline = time.monotonic() + 180
    while ref.alive:                       # rank 0 exits at once; the pool sees the stream break
        assert time.monotonic() < deadline, f"{worker} was not reported dead after its rank 1 died"
        time.sleep(0.05)
    while True:
        try:
            info = cluster.call(worker, "ready")
        except Exception:          # down, or restarting
            info = None
        if info is not None and info.pid != pid and ref.alive:
            break
        assert time.monotonic() < deadline, f"{worker} did not come back with fresh ranks"
        time.sleep(0.5)
    assert info.tensor_parallel_size == 2
    prompt = _prompts()[2]
    while True:   # the actor answers before its first report reaches the router: UNAVAILABLE until then
        try:
            got = asyncio.run(_complete(cluster.target, prompt))
            break
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, e
            time.sleep(0.5)
    assert got.tokens == hf_greedy(load_hf_model(model_dir), prompt, MAX_NEW)
    cluster.wait_idle()


def test_a_rank_dying_mid_request_migrates_it(tiny_llama_dir, tmp_path_factory):
    """Two decode workers at TP 2: kill a rank of the one streaming a long request; the worker
    goes down with it and the request migrates to the other, its tokens still transformers'."""
    import ray

    cluster = _cluster(tiny_llama_dir, tmp_path_factory.mktemp("ray"), 1, 2, decode_workers=2)
    try:
        prompt, n = _prompts()[1], 160
        expect = hf_greedy(load_hf_model(tiny_llama_dir), prompt, n)
        migrations0 = cluster.sample("pdserve_request_migrations_total")

        async def run():
            async with GenerationClient(cluster.target) as c:
                task = asyncio.ensure_future(c.complete(prompt_token_ids=prompt, max_tokens=n, temperature=0.0,
                                                        ignore_eos=True))
                deadline = time.monotonic() + 60
                while True:
                    running = {w: (await asyncio.to_thread(cluster.call, w, "report")).stats.running
                               for w in ("decode-0", "decode-1")}
                    busy = [w for w, r in running.items() if r]
                    if busy:
                        break
                    assert not task.done() and time.monotonic() < deadline, "the request never ran on a decode worker"
                    await asyncio.sleep(0.02)
                ray.kill(cluster.backend.workers[busy[0]].placement.ranks[0], no_restart=False)
                return await task

        got = asyncio.run(run())
        assert got.tokens == expect
        assert cluster.sample("pdserve_request_migrations_total") - migrations0 >= 1
    finally:
        cluster.close()

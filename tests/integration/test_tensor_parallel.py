"""`LLM(model, tensor_parallel_size=2)`: greedy outputs equal transformers `generate` token for
token (Llama and Qwen2 with 2 KV heads split over the ranks, and 1 KV head replicated on both),
each rank's weights and KV pool agree with `pdserve plan`'s per-rank figures, a size that
cannot split the model is refused, and closing leaves no rank process behind."""
from __future__ import annotations

import multiprocessing
import random

import pytest
import torch.distributed as dist

from cluster.tools.planner.capacity import CapacityInputs, plan_capacity
from cluster.tools.planner.model_spec import resolve_model
from engine import LLM, SamplingParams
from tiny_models import hf_greedy, load_hf_model, make_tiny_model

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
BLOCKS, BLOCK_SIZE, MAX_LEN = 48, 16, 128


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(36)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 16, 41, 77)]
    return prompts + [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (0, 7)]


@pytest.fixture(scope="module")
def tiny_llama_1kv_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama_1kv"), "llama", num_kv_heads=1, seed=3)


MODELS = {"llama-2kv": "tiny_llama_dir", "qwen2-2kv": "tiny_qwen2_dir", "llama-1kv-replicated": "tiny_llama_1kv_dir"}


def _ranks() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pdserve-tp-rank")]


def _no_rank_left() -> bool:
    return not _ranks()


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_greedy_matches_transformers(request, name):
    model_dir = request.getfixturevalue(MODELS[name])
    hf = load_hf_model(model_dir)
    prompts = _prompts(hf.config.vocab_size, seed=len(name))
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    with LLM(str(model_dir), tensor_parallel_size=2, num_kv_blocks=BLOCKS, max_model_len=MAX_LEN,
             max_num_batched_tokens=29) as llm:                  # chunked prefill
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected
        again = llm.generate(prompts, GREEDY)                   # prefix cache hits, still equal
        assert [o.outputs[0].token_ids for o in again] == expected
        assert sum(o.num_cached_tokens for o in again) > 0
        llm.engine.check_integrity()
        heads = [m.kv_heads for m in llm.engine.runner.memory_per_rank()]
        assert heads == [1, 1]        # 2 KV heads split, or 1 replicated: one head in each rank's pool
    assert _no_rank_left() and not dist.is_initialized()


def test_tp2_block_moves_reach_every_rank(tiny_llama_dir):
    """A pool too small for the batch: preemption swaps blocks to host and back on every rank."""
    hf = load_hf_model(tiny_llama_dir)
    prompts = _prompts(hf.config.vocab_size, seed=5)
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, num_kv_blocks=12, max_model_len=MAX_LEN, max_num_seqs=8,
             num_host_kv_blocks=64, preemption_mode="swap") as llm:
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
        stats = llm.engine.stats()
        assert stats.swap_preemptions > 0 and stats.kv_bytes_moved > 0


@pytest.mark.parametrize("name", ["llama-2kv", "llama-1kv-replicated"])
def test_per_rank_memory_matches_the_planner(request, name):
    model_dir = request.getfixturevalue(MODELS[name])
    spec = resolve_model(str(model_dir))
    with LLM(str(model_dir), tensor_parallel_size=2, num_kv_blocks=BLOCKS, max_model_len=MAX_LEN) as llm:
        ranks = llm.engine.runner.memory_per_rank()
    context = BLOCKS * BLOCK_SIZE
    plan = plan_capacity(spec, CapacityInputs(device_memory=1 << 30, weights=spec.weight_bytes, context_len=context,
                                              kv_dtype="fp32", tp=2))
    for m in ranks:
        assert m.weight_bytes == pytest.approx(plan.weights_per_rank, rel=0.05), m
        assert m.kv_pool_bytes == pytest.approx(plan.kv_bytes_per_sequence, rel=0.05), m
    assert ranks[0].weight_bytes < 0.6 * spec.weight_bytes        # split, not replicated


def test_a_size_that_cannot_split_the_model_is_refused_before_any_rank_starts(tiny_llama_dir):
    with pytest.raises(ValueError, match="Use one of: 1, 2, 4"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, num_kv_blocks=BLOCKS, max_model_len=MAX_LEN)
    assert _no_rank_left()


def test_a_dropped_engine_stops_its_ranks_and_the_next_one_starts(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, num_kv_blocks=BLOCKS, max_model_len=MAX_LEN)
    first = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids
    del llm                                                    # no close(): the finalizer stops the ranks
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, num_kv_blocks=BLOCKS, max_model_len=MAX_LEN) as llm:
        assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids == first
        with pytest.raises(RuntimeError, match="one tensor-parallel engine per process"):
            LLM(str(tiny_llama_dir), tensor_parallel_size=2, num_kv_blocks=BLOCKS, max_model_len=MAX_LEN)
        assert len(_ranks()) == 1                              # the refused one started none
    assert _no_rank_left()


def test_a_rank_that_fails_to_load_is_named_at_once_and_leaves_nothing(tmp_path):
    from engine.config import EngineConfig
    from engine.parallel.group import Rendezvous, TPGroup
    from engine.parallel.local_ranks import LocalRanks

    config = EngineConfig(model=str(tmp_path / "no-such-model"), tensor_parallel_size=2)
    ranks = LocalRanks.spawn(config, TPGroup(rank=0, world_size=2, device="cpu"), Rendezvous.listen(2).address)
    try:
        with pytest.raises(RuntimeError, match="rank 1: ValueError: .*no-such-model"):
            ranks.wait_ready(timeout_s=120)
    finally:
        ranks.shutdown()
    assert _no_rank_left() and not dist.is_initialized()


def test_the_rendezvous_port_is_held_from_the_moment_it_is_named(tmp_path):
    """The ranks' meeting point listens before its address exists: no other socket can bind the
    port while the ranks load (a port found free and bound later could be taken meanwhile)."""
    import socket

    from engine.parallel.group import Rendezvous, TPGroup

    meet = Rendezvous.listen(1)
    host, port = meet.address.removeprefix("tcp://").rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) == meet.store.port > 0
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError):
            s.bind(("127.0.0.1", int(port)))
    group = TPGroup(rank=0, world_size=1, device="cpu")
    group.connect(meet.address)        # a rank in another process joins by the address
    try:
        assert group.connected and group.all_gather("rank0") == ["rank0"]
    finally:
        group.destroy()
    with pytest.raises(ValueError, match="tcp://host:port"):
        TPGroup(rank=0, world_size=1, device="cpu").connect("env://")

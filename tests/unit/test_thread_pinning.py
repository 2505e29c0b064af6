"""EngineConfig.omp_threads_bind: the values it takes, and that the stepping thread's OpenMP team
ends up on one core per thread (read back from the kernel's affinity masks)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from engine.config import EngineConfig
from engine.thread_pinning import ThreadPinner, parse_bind, resolve_cores


def test_parse_bind_values():
    assert parse_bind("off") is None
    assert parse_bind("auto") == ()
    assert parse_bind("0-1,3") == (0, 1, 3)
    assert parse_bind(" 2 ") == (2,)


@pytest.mark.parametrize("bad", ["", "on", "1-0", "-1", "0,,1", "0,0", "0-2,1"])
def test_bad_bind_values_say_how_to_fix(bad):
    with pytest.raises(ValueError, match="omp_threads_bind"):
        EngineConfig(model="m", omp_threads_bind=bad)


def test_bind_refused_with_tensor_parallelism():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="m", omp_threads_bind="auto", tensor_parallel_size=2)


def test_resolve_cores_checks_count_and_mask():
    assert resolve_cores("off", 2, {0, 1}) is None
    assert resolve_cores("auto", 2, {3, 1}) == (1, 3)
    assert resolve_cores("auto", 3, {0, 1}) is None          # more threads than cores: left unpinned
    assert resolve_cores("auto", 1, {0, 1}) is None          # a smaller team may share the host: unpinned
    assert resolve_cores("1,0", 2, {0, 1}) == (1, 0)
    with pytest.raises(ValueError, match="one core per thread"):
        resolve_cores("0", 2, {0, 1})
    with pytest.raises(ValueError, match="outside"):
        resolve_cores("0,5", 2, {0, 1})


def _pin_on_fresh_thread(spec: str, threads: int) -> tuple[ThreadPinner, dict[int, set[int]], int]:
    """Pin on a new thread (pytest's own thread keeps its mask); read the team's masks back."""
    from engine.attention.kernels import cpu_kernel_available

    if not cpu_kernel_available():
        pytest.skip("pdserve's CPU kernels did not build here")
    out: dict = {}

    def body() -> None:
        pinner = ThreadPinner(spec)
        pinner.ensure()
        torch.ones(1 << 16).add_(1)          # the team runs an ATen op after the pinning
        pinner.ensure()                      # once per thread: a second call changes nothing
        out["masks"] = {tid: os.sched_getaffinity(tid) for tid in pinner.pinned}
        out["pinner"], out["me"] = pinner, threading.get_native_id()

    _run_on_fresh_thread(body, threads)
    return out["pinner"], out["masks"], out["me"]


def _run_on_fresh_thread(body, threads: int) -> None:
    """``body`` on a new thread with ``threads`` intra-op threads; pytest's thread keeps its mask."""
    before, main_mask = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(threads)
    try:
        t = threading.Thread(target=body)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(before)
    assert os.sched_getaffinity(0) == main_mask


def test_auto_pins_each_team_thread_to_its_own_core():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 8:
        pytest.skip("a team of one thread per core is too many threads for a unit test here")
    pinner, masks, me = _pin_on_fresh_thread("auto", len(cores))
    assert len(pinner.pinned) == len(cores) and me in pinner.pinned    # the stepping thread is team thread 0
    assert pinner.pinned[me] == cores[0]
    assert sorted(pinner.pinned.values()) == cores
    assert masks == {tid: {core} for tid, core in pinner.pinned.items()}


def test_explicit_core_list_is_applied_in_team_order():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    pinner, masks, me = _pin_on_fresh_thread(f"{cores[1]},{cores[0]}", 2)
    assert pinner.pinned[me] == cores[1]
    assert masks == {tid: {core} for tid, core in pinner.pinned.items()}


def test_off_pins_nothing():
    pinner = ThreadPinner("off")
    pinner.ensure()
    assert pinner.pinned == {}


def test_llm_pins_while_it_steps_and_stays_greedy_exact(tiny_llama_dir, tiny_llama_hf):
    """LLM's default ("auto", one intra-op thread per core): generate() runs pinned, then its
    caller gets its own mask back while the GOMP workers stay on their cores."""
    from engine import LLM, SamplingParams
    from tiny_models import hf_greedy

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 8:
        pytest.skip("a team of one thread per core is too many threads for a unit test here")
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=32, max_model_len=128)
    prompt = [5, 9, 17, 33, 2, 71, 8]
    out: dict = {}

    def body() -> None:
        out["tokens"] = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0,
                                                                ignore_eos=True))[0].token_ids
        out["me"], out["my_mask"] = threading.get_native_id(), os.sched_getaffinity(0)
        out["masks"] = {tid: os.sched_getaffinity(tid) for tid in llm.engine.thread_pinner.pinned}

    try:
        _run_on_fresh_thread(body, len(cores))
    finally:
        llm.close()
    pinned = llm.engine.thread_pinner.pinned
    assert len(pinned) == len(cores) and pinned[out["me"]] == cores[0]     # the caller stepped as thread 0
    assert out["my_mask"] == set(cores)                                      # and got its mask back
    assert {tid: m for tid, m in out["masks"].items() if tid != out["me"]} == \
        {tid: {core} for tid, core in pinned.items() if tid != out["me"]}
    assert out["tokens"] == hf_greedy(tiny_llama_hf, prompt, 6)

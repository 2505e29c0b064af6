"""Each frontend runs without the other, over the stack's one request runner: HTTP with gRPC
off (grpc_port 0), gRPC with HTTP off (http_port 0), and the same greedy request gives the
same tokens either way as with both on. Both off is refused before anything starts."""
from __future__ import annotations

import asyncio

import pytest

from cluster.cli.client import GenerationClient
from cluster.config import ServeConfig
from cluster.server_stack import start_stack
from grpc_harness import LoopThread, free_port, http_greedy_tokens
from tiny_models import hf_greedy, load_hf_model

PROMPT = "The quick brown fox"
MAX_TOKENS = 12


def _stack(model_dir, *, grpc: bool, http: bool):
    cfg = ServeConfig(model=str(model_dir), ray=False, host="127.0.0.1", metrics_port=0,
                      grpc_port=free_port() if grpc else 0, http_port=free_port() if http else 0,
                      num_kv_blocks=64, max_model_len=256)
    loop = LoopThread()
    return loop, loop.run(start_stack(cfg), timeout=300)


def _stop(loop: LoopThread, stack) -> None:
    try:
        loop.run(stack.drain_and_stop(10))
    finally:
        loop.close()


def _http_tokens(url: str, ids: list[int]) -> list[int]:
    return http_greedy_tokens(url, ids, MAX_TOKENS)


def _grpc_tokens(target: str, ids: list[int]) -> list[int]:
    async def go():
        async with GenerationClient(target) as c:
            return (await c.complete(prompt_token_ids=ids, max_tokens=MAX_TOKENS, temperature=0.0,
                                     ignore_eos=True)).tokens
    return asyncio.run(go())


@pytest.fixture(scope="module")
def ids(tiny_llama_dir) -> list[int]:
    from engine.tokenizer import Tokenizer
    return Tokenizer.load(tiny_llama_dir).encode(PROMPT)


@pytest.fixture(scope="module")
def both_on(tiny_llama_dir, ids):
    """(HTTP tokens, gRPC tokens) of the request with both frontends on, and HF's greedy ids."""
    loop, stack = _stack(tiny_llama_dir, grpc=True, http=True)
    try:
        assert stack.http.state.runner is stack.grpc.runner is stack.runner
        return _http_tokens(stack.http.url, ids), _grpc_tokens(stack.grpc.target, ids)
    finally:
        _stop(loop, stack)


def test_both_on_agree_with_hf(tiny_llama_dir, ids, both_on):
    want = hf_greedy(load_hf_model(tiny_llama_dir), ids, MAX_TOKENS)
    assert both_on == (want, want)


def test_http_serves_with_grpc_off(tiny_llama_dir, ids, both_on):
    loop, stack = _stack(tiny_llama_dir, grpc=False, http=True)
    try:
        assert stack.grpc is None and stack.http.state.runner is stack.runner
        banner = stack.banner()
        assert "gRPC" not in banner and "grpcurl" not in banner and stack.http.url in banner
        assert _http_tokens(stack.http.url, ids) == both_on[0]
        assert loop.run(stack.runner.wait_idle(30))     # the response's in-flight count came back
    finally:
        _stop(loop, stack)
    assert stack.http.serving is False


def test_grpc_serves_with_http_off(tiny_llama_dir, ids, both_on):
    loop, stack = _stack(tiny_llama_dir, grpc=True, http=False)
    try:
        assert stack.http is None and stack.grpc.runner is stack.runner
        banner = stack.banner()
        assert stack.grpc.target in banner and "HTTP" not in banner and "curl -s" not in banner
        assert _grpc_tokens(stack.grpc.target, ids) == both_on[1]
    finally:
        _stop(loop, stack)
    assert stack.grpc.serving is False

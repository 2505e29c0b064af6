"""`start_stack` claims the frontends' ports before anything starts (cluster/frontends/ports.py),
and a start that fails part-way stops what it had started: the backend (on Ray, its worker
actors), the frontends that listened, and the ports they held.

A leaked backend was seen in CI: a gRPC port taken while Ray started failed one test's stack
after its workers were up, they stayed, and the next test's cluster never got a CPU."""
from __future__ import annotations

import socket

import grpc
import pytest

from cluster.config import ServeConfig
from cluster.frontends.ports import claim_ports
from cluster.orchestration.local import LocalEngineBackend
from cluster.server_stack import start_stack
from grpc_harness import LoopThread, free_port


class RecordingBackend(LocalEngineBackend):
    """The real one-engine backend, recording its start and stop."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    async def start(self) -> None:
        self.calls.append("start")
        await super().start()

    async def stop(self) -> None:
        self.calls.append("stop")
        await super().stop()


def _listening(port: int = 0) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _bindable(port: int) -> bool:
    """As a server binds (SO_REUSEADDR: a closed connection's TIME_WAIT does not hold the port)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _cfg(model_dir, **kw) -> ServeConfig:
    return ServeConfig(model=str(model_dir), ray=False, host="127.0.0.1", num_kv_blocks=64, max_model_len=256, **kw)


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def test_a_taken_port_fails_the_start_before_the_model_is_read(loop):
    """The port is checked before preflight (which would refuse the missing model) and Ray."""
    taken, http_port = _listening(), free_port()
    try:
        cfg = ServeConfig(model="/nonexistent/model", ray=True, host="127.0.0.1", metrics_port=0,
                          grpc_port=taken.getsockname()[1], http_port=http_port)
        with pytest.raises(RuntimeError, match="pick a free --grpc-port"):
            loop.run(start_stack(cfg), timeout=60)
        assert _bindable(http_port)          # nothing of the failed start holds a port
    finally:
        taken.close()


def test_a_start_failing_after_the_backend_stops_it_and_frees_the_ports(tiny_llama_dir, loop):
    """The metrics port is the last thing bound: taken, the start fails after the backend and both
    frontends started, and every one of them is stopped again."""
    taken = _listening()
    grpc_port, http_port = free_port(), free_port()
    cfg = _cfg(tiny_llama_dir, grpc_port=grpc_port, http_port=http_port, metrics_port=taken.getsockname()[1])
    from cluster.orchestration.launcher import engine_config
    backend = RecordingBackend(engine_config(cfg))
    try:
        with pytest.raises(RuntimeError, match="pick a free --metrics-port"):
            loop.run(start_stack(cfg, backend), timeout=300)
    finally:
        taken.close()
    assert backend.calls == ["start", "stop"]
    assert _bindable(grpc_port) and _bindable(http_port)


def test_a_claimed_grpc_port_is_held_for_grpc_alone():
    """While claimed, no other socket binds the port; gRPC's server binds beside the claim and
    serves once the claim is released."""
    import asyncio

    port = free_port()
    claims = claim_ports("127.0.0.1", port, 0)
    try:
        assert not _bindable(port)

        async def serve() -> None:
            server = grpc.aio.server()
            assert server.add_insecure_port(f"127.0.0.1:{port}") == port
            claims.release_grpc()
            await server.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                    await asyncio.wait_for(ch.channel_ready(), 10)
            finally:
                await server.stop(0)
        asyncio.run(serve())
    finally:
        claims.release()
    assert _bindable(port)


def test_claims_are_both_or_neither():
    """An HTTP port that is taken releases the gRPC claim made before it."""
    taken, grpc_port = _listening(), free_port()
    try:
        with pytest.raises(RuntimeError, match="pick a free --http-port"):
            claim_ports("127.0.0.1", grpc_port, taken.getsockname()[1])
        assert _bindable(grpc_port)
    finally:
        taken.close()

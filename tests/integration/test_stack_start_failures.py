"""`start_stack` claims the endpoints' ports before anything starts (cluster/frontends/ports.py),
and a start that fails part-way stops what it had started: the backend (on Ray, its worker
actors), the frontends that listened, and the ports they held.

A leaked backend was seen in CI: a gRPC port taken while Ray started failed one test's stack
after its workers were up, they stayed, and the next test's cluster never got a CPU."""
from __future__ import annotations

import asyncio
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


def _bindable(port: int, reuse: bool = True) -> bool:
    """As a server binds (SO_REUSEADDR: a closed connection's TIME_WAIT does not hold the port),
    or a plain bind (`reuse=False`)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
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


def test_a_taken_metrics_port_fails_the_start_before_the_backend(tiny_llama_dir, loop):
    """The metrics port is claimed with the frontends' (it used to be bound last, after Ray and
    the workers): taken, the start fails before the backend starts, and the frontends' claims
    are released."""
    taken = _listening()
    grpc_port, http_port = free_port(), free_port()
    cfg = _cfg(tiny_llama_dir, grpc_port=grpc_port, http_port=http_port, metrics_port=taken.getsockname()[1])
    from cluster.orchestration.launcher import engine_config
    backend = RecordingBackend(engine_config(cfg))
    try:
        with pytest.raises(RuntimeError, match="pick a free --metrics-port"):
            loop.run(start_stack(cfg, backend), timeout=60)
    finally:
        taken.close()
    assert backend.calls == []
    assert _bindable(grpc_port) and _bindable(http_port)


def test_a_start_failing_after_the_backend_stops_it_and_frees_the_ports(tiny_llama_dir, loop, monkeypatch):
    """The metrics server is the last thing started: when it fails (here made to), the start
    fails after the backend and both frontends started, and every one of them is stopped again,
    the metrics port's claim included."""
    import cluster.observability.metrics_server as metrics_server

    def fail(metrics, host, port):
        raise RuntimeError(f"cannot serve metrics on {host}:{port} (injected); pick a free --metrics-port")
    monkeypatch.setattr(metrics_server, "start_metrics_server", fail)
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    cfg = _cfg(tiny_llama_dir, grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port)
    from cluster.orchestration.launcher import engine_config
    backend = RecordingBackend(engine_config(cfg))
    with pytest.raises(RuntimeError, match="injected"):
        loop.run(start_stack(cfg, backend), timeout=300)
    assert backend.calls == ["start", "stop"]
    assert _bindable(grpc_port) and _bindable(http_port) and _bindable(metrics_port)


def test_a_claimed_grpc_port_is_held_until_grpc_binds_it(tiny_llama_dir, loop):
    """While claimed, a plain bind of the port fails; serve_grpc releases the claim as it binds,
    serves, and a second endpoint (or another stack's claim) on that port is then refused:
    without SO_REUSEPORT, two servers cannot silently share one port."""
    from cluster.frontends.grpc.server import serve_grpc
    from cluster.frontends.runner import RequestRunner
    from cluster.observability.metrics import Metrics
    from cluster.orchestration.launcher import engine_config

    port = free_port()
    cfg = _cfg(tiny_llama_dir, grpc_port=port, http_port=0, metrics_port=0)
    claims = claim_ports("127.0.0.1", port, 0)
    backend = LocalEngineBackend(engine_config(cfg))
    try:
        assert not _bindable(port, reuse=False)

        async def serve():
            await backend.start()
            return await serve_grpc(RequestRunner.from_config(backend, cfg, Metrics()), cfg, claim=claims)
        server = loop.run(serve(), timeout=120)
        try:
            assert claims.grpc is None and server.port == port

            async def ready() -> None:
                async with grpc.aio.insecure_channel(server.target) as ch:
                    await asyncio.wait_for(ch.channel_ready(), 10)
            asyncio.run(ready())
            with pytest.raises(RuntimeError, match="pick a free --grpc-port"):
                claim_ports("127.0.0.1", port, 0)
            with pytest.raises(RuntimeError, match="pick a free --grpc-port"):
                loop.run(serve_grpc(RequestRunner.from_config(backend, cfg, Metrics()), cfg), timeout=60)
        finally:
            loop.run(server.stop(grace=0))
    finally:
        claims.release()
        loop.run(backend.stop())
    assert _bindable(port)


@pytest.mark.parametrize("ports, match", [((8000, 8000, 9400), "two ports"),
                                           ((8000, 8001, 8000), "metrics need a port of their own"),
                                           ((8000, 8001, 8001), "metrics need a port of their own")])
def test_one_port_for_two_endpoints_is_refused(ports, match):
    grpc_port, http_port, metrics_port = ports
    cfg = ServeConfig(model="/nonexistent", grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port)
    with pytest.raises(ValueError, match=match):
        loop = LoopThread()
        try:
            loop.run(start_stack(cfg), timeout=30)
        finally:
            loop.close()


def test_claims_are_all_or_none():
    """A port that is taken releases the claims made before it."""
    taken, grpc_port, http_port = _listening(), free_port(), free_port()
    try:
        with pytest.raises(RuntimeError, match="pick a free --http-port"):
            claim_ports("127.0.0.1", grpc_port, taken.getsockname()[1])
        assert _bindable(grpc_port)
        with pytest.raises(RuntimeError, match=r"pick a free --metrics-port \(0 picks any free port\)"):
            claim_ports("127.0.0.1", grpc_port, http_port, taken.getsockname()[1])
        assert _bindable(grpc_port) and _bindable(http_port)
    finally:
        taken.close()


_PROBE = """
import json, socket, struct, sys
from cluster.frontends.ports import claim_ports
claims = claim_ports("127.0.0.1", 40001, 40002) if sys.argv[1] == "claimed" else None
binds, connects = set(), set()
for _ in range(40):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        binds.add(s.getsockname()[1])
listener = socket.socket()
listener.bind(("127.0.0.1", 40003))
listener.listen(64)
for _ in range(40):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # no TIME_WAIT
    s.connect(("127.0.0.1", 40003))
    connects.add(s.getsockname()[1])
    s.close()
print(json.dumps([sorted(binds), sorted(connects)]))
"""


def _probe(mode: str) -> list[list[int]]:
    """The probe in a network namespace of its own whose ephemeral ports are 40000-40003."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a network namespace of its own")
    repo = str(Path(__file__).resolve().parents[2])
    script = (f"ip link set lo up && sysctl -qw net.ipv4.ip_local_port_range='40000 40003' && "
              f"exec {sys.executable} -c '{_PROBE}' {mode}")
    out = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": repo}, check=True)
    return json.loads(out.stdout)


def test_claimed_ports_are_never_handed_out_as_ephemeral_ports():
    """The CI failure's interleaving, made certain: with four ephemeral ports, unclaimed ports are
    handed to bind(0) (odd) and connect() (even) callers; claimed, never (a started Ray opens such
    sockets by the hundred while the frontends wait for the backend)."""
    free_binds, free_connects = _probe("free")
    assert 40001 in free_binds and 40002 in free_connects    # 40 tries each; a miss is 2**-40
    binds, connects = _probe("claimed")
    assert binds == [40003] and connects == [40000]

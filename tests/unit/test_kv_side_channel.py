"""Metadata side channel: binds exactly where told, never to a wildcard, serves
the current metadata with the engine's incarnation, refuses other agent names."""
import socket

import pytest

from grpc_harness import held_port
from kvtransfer import side_channel
from kvtransfer.nixl_backend import NixlConfig
from kvtransfer.registry import available_backends
from kvtransfer.settings import TransferSettings


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "*"])
def test_refuses_wildcard_bind(host):
    with pytest.raises(ValueError, match="wildcard|empty host"):
        side_channel.MetadataServer(host, 0, "a", "inc", lambda: b"md")
    with pytest.raises(ValueError, match="wildcard|empty host"):
        NixlConfig(host=host)
    with pytest.raises(ValueError, match="wildcard|empty host"):
        NixlConfig(host="127.0.0.1", side_channel_host=host)


def test_rejects_bad_port():
    with pytest.raises(ValueError, match="side_channel_port"):
        NixlConfig(side_channel_port=70000)


def test_serves_current_metadata_on_the_given_address():
    state = {"md": b"first"}
    server = side_channel.MetadataServer("127.0.0.1", 0, "agent-a", "inc-1", lambda: state["md"])
    try:
        host, port = server.address
        assert host == "127.0.0.1" and port == server.port > 0
        reply = side_channel.fetch_metadata("127.0.0.1", port, "agent-a", timeout=5)
        assert (reply.incarnation, reply.metadata) == ("inc-1", b"first")
        state["md"] = b"x" * 300_000   # bigger than one recv
        assert side_channel.fetch_metadata("127.0.0.1", port, "agent-a").metadata == state["md"]
        with pytest.raises(ConnectionError, match="does not serve agent"):
            side_channel.fetch_metadata("127.0.0.1", port, "agent-b")
    finally:
        server.close()
    with pytest.raises(ConnectionError, match="cannot fetch"):
        side_channel.fetch_metadata("127.0.0.1", port, "agent-a", timeout=2)
    server.close()   # twice is harmless


def test_fetch_without_address_is_a_clear_error():
    with pytest.raises(ValueError, match="no side channel address"):
        side_channel.fetch_metadata("", 0, "agent-a")


def test_garbage_peer_is_a_connection_error():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    import threading

    def answer():   # a source speaks first (the membership challenge): this one answers in HTTP
        conn, _ = listener.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        try:
            conn.recv(100)
        except OSError:   # the reader gave up on the reply and reset the connection
            pass
        conn.close()
    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        with pytest.raises(ConnectionError, match="does not speak pdserve's KV side-channel protocol"):
            side_channel.fetch_metadata("127.0.0.1", port, "agent-a", timeout=5)
    finally:
        t.join(5)
        listener.close()


@pytest.mark.parametrize("backend", available_backends())
def test_settings_thread_the_side_channel_port(backend):
    import torch
    from kvtransfer.layout import KVPoolLayout
    if backend == "ucxx":
        pytest.skip("ucxx addresses peers by UCX worker address, no socket")
    with held_port() as port:   # held while the engine starts (NIXL's UCX opens its own listeners first)
        engine = TransferSettings(backend=backend, side_channel_port=port).create("settings-port")
    try:
        pool = torch.zeros(4, 256, dtype=torch.uint8)
        engine.register_pool(KVPoolLayout.from_tensor(pool))
        info = engine.peer_info()
        assert (info.host, info.port) == ("127.0.0.1", port)
    finally:
        engine.close()

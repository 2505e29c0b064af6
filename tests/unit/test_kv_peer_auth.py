"""The KV side channels serve cluster members only (kvtransfer/peer_auth.py):
a reader without the cluster's secret, or with a wrong one, gets no byte of a
pool and no metadata; a source without it cannot feed a reader."""
from __future__ import annotations

import socket
import threading

import pytest
import torch

from kvtransfer import side_channel
from kvtransfer.engine import PeerInfo, TransferStatus
from kvtransfer.layout import KVPoolLayout
from kvtransfer.peer_auth import PeerAuthError, accept_peer, join_peer
from kvtransfer.tcp_backend import TcpConfig, TcpEngine

SECRET = b"s3cret-of-this-cluster-0123456789"


def _pair(reader_secret: bytes):
    src = torch.arange(4 * 1024, dtype=torch.int32).view(4, 1024)
    dst = torch.zeros(4, 1024, dtype=torch.int32)
    source = TcpEngine("prefill-a", TcpConfig(secret=SECRET))
    source.register_pool(KVPoolLayout.from_tensor(src))
    reader = TcpEngine("decode-a", TcpConfig(secret=reader_secret, io_timeout_s=5))
    reader.register_pool(KVPoolLayout.from_tensor(dst))
    return source, reader, src, dst


def test_a_member_reads_and_a_wrong_or_missing_secret_gets_nothing():
    for secret, ok in ((SECRET, True), (b"another-cluster", False), (b"", False)):
        source, reader, src, dst = _pair(secret)
        try:
            h = reader.read(source.peer_info(), [1, 2], [0, 3], notify=b"r1")
            status = h.wait(5)
            if ok:
                assert status is TransferStatus.DONE
                assert torch.equal(dst[0], src[1]) and torch.equal(dst[3], src[2])
            else:
                assert status is TransferStatus.FAILED and "does not hold the cluster's secret" in h.error, h.error
                assert int(dst.abs().sum()) == 0
                assert source.get_notifications() == []
        finally:
            reader.close()
            source.close()


def test_a_stranger_speaking_the_read_protocol_directly_gets_no_pool_bytes():
    source, reader, src, _ = _pair(SECRET)
    reader.close()
    try:
        peer = source.peer_info()
        with socket.create_connection((peer.host, peer.port), timeout=5) as s:
            import struct
            name = b"intruder"
            addr = src.data_ptr()
            # a whole read request (48 bytes, as long as a membership proof, so the source reads
            # all of it as one and closes cleanly)
            s.sendall(struct.pack("!4sHII", b"PDKV", len(name), 1, 10) + name + struct.pack("!QQ", addr, 4096)
                      + b"notify-me!")
            got = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        assert got[:4] == b"PDAU" and len(got) <= 4 + 16 + 1, len(got)   # the challenge, a refusal, closed
        assert got[-1:] == b"\x01"
    finally:
        source.close()


def test_a_source_without_the_secret_cannot_feed_a_reader():
    a, b = socket.socketpair()
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("accepted", accept_peer(a, b"wrong")))
    t.start()
    with pytest.raises(PeerAuthError, match="refused this worker"):
        join_peer(b, SECRET, "a fake source")
    t.join(5)
    assert result == {"accepted": False}
    a.close(), b.close()
    # both know a secret, but different ones -> the reader refuses the source's proof
    a, b = socket.socketpair()

    def lying_source():   # accepts any reader, then proves with another secret
        import hashlib
        import hmac
        import os
        ours = os.urandom(16)
        a.sendall(b"PDAU" + ours)
        theirs = a.recv(16 + 32)[:16]
        a.sendall(b"\x00" + hmac.new(b"wrong", b"source" + theirs + ours, hashlib.sha256).digest())
    t = threading.Thread(target=lying_source)
    t.start()
    with pytest.raises(PeerAuthError, match="could not prove"):
        join_peer(b, SECRET, "a fake source")
    t.join(5)
    a.close(), b.close()


def test_the_metadata_side_channel_serves_members_only():
    server = side_channel.MetadataServer("127.0.0.1", 0, "agent-a", "inc-1", lambda: b"metadata!", secret=SECRET)
    try:
        host, port = server.address
        reply = side_channel.fetch_metadata(host, port, "agent-a", timeout=5, secret=SECRET)
        assert (reply.incarnation, reply.metadata) == ("inc-1", b"metadata!")
        for wrong in (b"", b"guess"):
            with pytest.raises(PeerAuthError, match="does not hold the cluster's secret"):
                side_channel.fetch_metadata(host, port, "agent-a", timeout=5, secret=wrong)
    finally:
        server.close()


def test_transfer_settings_never_print_the_secret():
    from kvtransfer.settings import TransferSettings
    assert "hunter2" not in repr(TransferSettings(secret="hunter2-hunter2-hunter2"))
    assert "hunter2" not in repr(TcpConfig(secret=b"hunter2"))

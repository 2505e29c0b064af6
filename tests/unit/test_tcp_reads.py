"""What keeps a tcp read from landing wrong bytes in the decode side's blocks.

1. The source refuses a read whose lease ended (its read guard): those
   blocks may already hold another request's KV.
2. An abandoned read never writes into its destination blocks afterwards.

The source here is a real socket server that accepts the read, answers OK,
then stalls (as a SIGSTOPped or wedged prefill node does) and only later sends
the bytes. Once ``abandon()`` (or a timed-out ``wait()``) has returned, the
decode side frees and reuses those blocks, so a late byte landing there would
corrupt another request's KV.
"""
from __future__ import annotations

import socket
import threading
import time

import torch

from kvtransfer.engine import PeerInfo, TransferStatus
from kvtransfer.layout import KVPoolLayout
from kvtransfer.leases import LeaseTable
from kvtransfer.peer_auth import accept_peer
from kvtransfer.tcp_backend import TcpConfig, TcpEngine

BLOCKS, BLOCK_BYTES = 4, 4096


class StallingSource:
    """Accepts one read, sends the OK byte, waits for ``release``, then sends
    ``nbytes`` of 0xAB (what a resumed source would send)."""

    def __init__(self, nbytes: int) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.nbytes = nbytes
        self.release = threading.Event()
        self.sent = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            assert accept_peer(conn, b"")   # the membership check (both sides without a secret)
            conn.recv(4096)             # the request header and descriptors
            conn.sendall(b"\x00")       # OK: the reader now blocks in recv for data
            self.release.wait(10)
            try:
                conn.sendall(b"\xab" * self.nbytes)
            except OSError:
                pass                    # the reader shut the connection: expected
            self.sent.set()

    def close(self) -> None:
        self.release.set()
        self.server.close()


def _pools():
    src = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
    dst = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
    return src, dst


def _reader_and_peer(src, dst, port):
    reader = TcpEngine("decode-x", TcpConfig(io_timeout_s=30.0))
    reader.register_pool(KVPoolLayout.from_tensor(dst))
    peer = PeerInfo("tcp", "prefill-x", KVPoolLayout.from_tensor(src), host="127.0.0.1", port=port)
    return reader, peer


def _check_no_late_write(abandon_via_wait: bool) -> None:
    src, dst = _pools()
    source = StallingSource(nbytes=2 * BLOCK_BYTES)
    reader, peer = _reader_and_peer(src, dst, source.port)
    try:
        handle = reader.read(peer, [0, 1], [2, 3])
        time.sleep(0.2)                 # the reader thread is blocked in recv
        assert handle.poll() is TransferStatus.PENDING
        if abandon_via_wait:
            assert handle.wait(0.05) is TransferStatus.TIMEOUT
        else:
            handle.abandon()
        source.release.set()            # the stalled source resumes and sends everything
        assert source.sent.wait(5)
        time.sleep(0.2)                 # time for a (wrong) late write to land
        assert int(dst.sum()) == 0, "bytes landed in the destination after abandon() returned"
        assert handle.poll() is TransferStatus.TIMEOUT
    finally:
        source.close()
        reader.close()


def test_abandon_stops_a_read_blocked_in_recv():
    _check_no_late_write(abandon_via_wait=False)


def test_timed_out_wait_stops_the_read():
    _check_no_late_write(abandon_via_wait=True)


def test_abandon_before_connect_writes_nothing_and_is_idempotent():
    src, dst = _pools()
    source = StallingSource(nbytes=BLOCK_BYTES)
    source.release.set()                # this source would answer at once
    reader, peer = _reader_and_peer(src, dst, source.port)
    try:
        with reader._lock:   # the read's thread cannot connect (it takes this lock) before both abandons
            handle = reader.read(peer, [0], [1])
            handle.abandon()
            handle.abandon()
        time.sleep(0.3)
        assert handle.poll() is TransferStatus.TIMEOUT
        assert int(dst.sum()) == 0
    finally:
        source.close()
        reader.close()


def test_source_refuses_a_read_once_the_lease_ended_and_serves_it_while_held():
    src, dst = _pools()
    src[0].fill_(7)
    now, freed = [0.0], []
    leases = LeaseTable(lambda: now[0], lambda lease, cause: freed.append(lease.request_id))
    source = TcpEngine("prefill-y", TcpConfig())
    source.register_pool(KVPoolLayout.from_tensor(src))
    source.set_read_guard(leases)
    reader = TcpEngine("decode-y", TcpConfig())
    reader.register_pool(KVPoolLayout.from_tensor(dst))
    try:
        leases.pin("req-1", [0], ttl=5)
        assert reader.read(source.peer_info(), [0], [1], notify=b"req-1").wait(10) is TransferStatus.DONE
        assert torch.equal(dst[1], src[0])
        leases.pin("req-2", [0], ttl=5)
        now[0] += 6
        leases.expire_due()
        dst.zero_()
        h = reader.read(source.peer_info(), [0], [1], notify=b"req-2")
        assert h.wait(10) is TransferStatus.FAILED
        assert "no longer holds" in h.error
        assert int(dst.sum()) == 0 and "req-2" in freed
        # a read without a notify message is not a lease read: served as before
        assert reader.read(source.peer_info(), [0], [2]).wait(10) is TransferStatus.DONE
    finally:
        reader.close()
        source.close()

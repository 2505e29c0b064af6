"""Proof of cluster membership on the KV side channels (tcp reads, NIXL metadata).

What a side channel hands out is enough to read a worker's KV pool, so every
connection starts with a mutual HMAC-SHA256 challenge over a secret the
cluster's workers share (the launcher makes one per deployment, or reads it
from `cluster_secret_file`, e.g. a Kubernetes Secret) and a stranger gets
nothing: no metadata, no pool bytes.

    source -> reader   b"PDAU" + source nonce (16 bytes)
    reader -> source   reader nonce (16) + HMAC(secret, b"reader" + source nonce + reader nonce)
    source -> reader   b"\\x00" + HMAC(secret, b"source" + reader nonce + source nonce)
                       (or b"\\x01" and a close: the reader's proof was wrong)

The reader checks the source's proof too, so a stranger posing as a source
cannot write bytes into the reader's blocks. Nothing is encrypted: run the
cluster network where only members reach it (docs/reliability.md).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket

_MAGIC = b"PDAU"
NONCE = 16
_MAC = hashlib.sha256().digest_size
_OK, _REFUSED = b"\x00", b"\x01"


class PeerAuthError(ConnectionError):
    """The other side does not hold the cluster's secret (or speaks another protocol)."""


def _mac(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, role + a + b, hashlib.sha256).digest()


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerAuthError("the peer closed the connection during the membership check")
        buf += chunk
    return bytes(buf)


def accept_peer(sock: socket.socket, secret: bytes) -> bool:
    """Source side. True: the reader proved membership (and got our proof back).
    False: it did not; it was told so and must get nothing more."""
    ours = os.urandom(NONCE)
    sock.sendall(_MAGIC + ours)
    reply = _recv(sock, NONCE + _MAC)
    theirs, proof = reply[:NONCE], reply[NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"reader", ours, theirs)):
        sock.sendall(_REFUSED)
        return False
    sock.sendall(_OK + _mac(secret, b"source", theirs, ours))
    return True


def join_peer(sock: socket.socket, secret: bytes, where: str) -> None:
    """Reader side: prove membership and check the source's proof; PeerAuthError otherwise."""
    head = _recv(sock, len(_MAGIC) + NONCE)
    if head[:len(_MAGIC)] != _MAGIC:
        raise PeerAuthError(f"{where} does not speak pdserve's KV side-channel protocol")
    theirs, ours = head[len(_MAGIC):], os.urandom(NONCE)
    sock.sendall(ours + _mac(secret, b"reader", theirs, ours))
    verdict = _recv(sock, 1)
    if verdict != _OK:
        raise PeerAuthError(f"{where} refused this worker: it does not hold the cluster's secret "
                            "(set the same cluster_secret_file on every node)")
    if not hmac.compare_digest(_recv(sock, _MAC), _mac(secret, b"source", ours, theirs)):
        raise PeerAuthError(f"{where} could not prove it holds the cluster's secret: not a member")

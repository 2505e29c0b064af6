"""The one way a KV block hash is made. Router and workers both call this.

A block's hash chains through its parent: ``hash(parent, tokens, extra)``.
The first block's parent is a fixed seed mixed with the tenant salt, so two
tenants with different salts never share a block. A quantized KV cache
(``kv_cache_dtype`` int8 / fp8_e4m3) hashes its root in its own blake2b domain
(``person``), so quantized and unquantized workers never share a block hash;
``auto`` keeps the plain root (hashes are the same as before quantization). Hashes are 64-bit ints,
stable across processes and machines (blake2b, not Python's ``hash``).
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

ROOT_SEED = b"pdserve-kv-v1"


def root_hash(cache_salt: str | None, kv_cache_dtype: str = "auto") -> int:
    """Parent hash of a prompt's first block, with the tenant salt and the KV storage dtype folded in."""
    person = b"" if kv_cache_dtype == "auto" else b"kv:" + kv_cache_dtype.encode("ascii")
    h = hashlib.blake2b(ROOT_SEED + (cache_salt or "").encode("utf-8"), digest_size=8, person=person)
    return int.from_bytes(h.digest(), "little")


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """Chained hash of one full block: position-aware through the parent."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(packed_tokens(token_ids))
    if extra:
        h.update(extra)
    return int.from_bytes(h.digest(), "little")


def packed_tokens(token_ids: Sequence[int]) -> bytes:
    """A block's tokens as the cache keeps them for its collision check:
    native uint32 bytes (4 bytes a token, and no references to Python ints,
    so storing or dropping a block touches no token objects)."""
    return array("I", token_ids).tobytes()


def content_hash(token_ids: Sequence[int]) -> int:
    """Position-free hash of a block's tokens alone (for debugging / events)."""
    return int.from_bytes(hashlib.blake2b(packed_tokens(token_ids), digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                 start: int = 0, parent: int | None = None, kv_cache_dtype: str = "auto") -> list[int]:
    """Chained hashes of every *full* block of ``token_ids``.

    ``start``/``parent`` let a caller extend a list it already has: pass the
    index of the first block to hash and the hash of the block before it.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_full = len(token_ids) // block_size
    if start >= n_full:
        return []
    # Same bytes as hash_block_tokens (parent as 8 little-endian bytes, then the
    # block's tokens as native uint32), packed once: the parent's digest *is*
    # its 8 little-endian bytes, so the chain never leaves bytes.
    data = packed_tokens(token_ids[start * block_size:n_full * block_size])
    root = root_hash(cache_salt, kv_cache_dtype) if parent is None else parent
    return packed_block_hashes(data, block_size, root)


def packed_block_hashes(data: bytes, block_size: int, parent: int) -> list[int]:
    """`block_hashes` of tokens already packed as native uint32 (``array('I')``
    or numpy ``uint32`` bytes), after the block whose hash is ``parent``; a
    trailing partial block is ignored."""
    step = block_size * 4
    end = len(data) - len(data) % step
    prev = parent.to_bytes(8, "little")
    blake = hashlib.blake2b
    digests: list[bytes] = []
    append = digests.append
    for off in range(0, end, step):
        prev = blake(prev + data[off:off + step], digest_size=8).digest()
        append(prev)
    from_bytes = int.from_bytes
    return [from_bytes(d, "little") for d in digests]

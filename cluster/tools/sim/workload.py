"""Workloads: Mooncake traces, synthetic shared-prefix datasets, time
compression, overlaid copies and a swinging arrival rate, and the expansion of trace hash ids into
tokens and pdserve block hashes.

A trace request names its prompt by hash ids, one per ``tokens_per_id``
(512 in Mooncake) tokens; equal ids at the same position mean a shared
prefix. `PromptBuilder` expands each id into ``tokens_per_id`` deterministic
tokens seeded by the id (equal ids -> equal tokens), cuts the prompt to the
request's input length, and computes pdserve's own chained block hashes
(`engine.block_hash.block_hashes`) with the copy's salt. The block size must
divide ``tokens_per_id`` so every id segment starts on a block boundary; the
hashes of a segment are then a function of (parent hash, id) and are memoised.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np

from engine.block_hash import packed_block_hashes, packed_tokens, root_hash
from engine.block_manager import cut_blocks
from engine.token_bytes import TokenBytes

MOONCAKE_TOKENS_PER_ID = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    salt: str | None = None


def load_mooncake(path: str | Path, limit: int | None = None, tokens_per_id: int = MOONCAKE_TOKENS_PER_ID,
                  output_scale: float | None = None, offset: int = 0) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace (timestamp ms, input/output lengths, hash ids):
    ``limit`` requests from line ``offset`` (a later window of the trace; request
    ids keep their line numbers, arrival times the trace's own).
    ``tokens_per_id`` < 512 shrinks prompts for small models: input lengths
    scale by ``tokens_per_id / 512``, output lengths by ``output_scale``
    (default: the same factor)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"trace {path} not found: give a Mooncake JSONL file, e.g. "
                         "../shared/traces/mooncake/conversation_trace.jsonl")
    if offset < 0:
        raise ValueError(f"trace offset is a line number: give a value >= 0, got {offset}")
    scale = tokens_per_id / MOONCAKE_TOKENS_PER_ID
    out_scale = scale if output_scale is None else output_scale
    out = []
    with path.open() as f:
        for i, line in enumerate(f):
            if i < offset:
                continue
            if limit is not None and i >= offset + limit:
                break
            row = json.loads(line)
            ids = tuple(int(h) for h in row["hash_ids"])
            n_in = max(1, min(len(ids) * tokens_per_id, math.ceil(int(row["input_length"]) * scale)))
            n_out = max(1, round(int(row["output_length"]) * out_scale))
            out.append(TraceRequest(f"r{i}", float(row["timestamp"]) / 1000.0, n_in, n_out, ids))
    if not out:
        raise ValueError(f"trace {path} has no requests from line {offset}: give an offset below its line count")
    return out


def synthetic_shared_prefix(num_requests: int, rate: float, num_prefixes: int, prefix_ids: int,
                            suffix_ids: int, output_length: int, tokens_per_id: int = 16,
                            seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals; each prompt = one of ``num_prefixes`` shared prefixes
    (``prefix_ids`` ids) + a unique suffix (``suffix_ids`` ids)."""
    if num_requests < 1 or rate <= 0 or num_prefixes < 1 or prefix_ids < 0 or suffix_ids < 1:
        raise ValueError("synthetic workload: num_requests >= 1, rate > 0, num_prefixes >= 1, "
                         "prefix_ids >= 0 and suffix_ids >= 1")
    rng = random.Random(seed)
    t, out, next_id = 0.0, [], num_prefixes * prefix_ids
    for i in range(num_requests):
        t += rng.expovariate(rate)
        p = rng.randrange(num_prefixes)
        ids = tuple(range(p * prefix_ids, (p + 1) * prefix_ids)) + tuple(range(next_id, next_id + suffix_ids))
        next_id += suffix_ids
        out.append(TraceRequest(f"s{i}", t, len(ids) * tokens_per_id, output_length, ids))
    return out


def compress_time(reqs: Iterable[TraceRequest], factor: float) -> list[TraceRequest]:
    """Divide every arrival time by ``factor`` (> 1 = faster). Same requests and
    sharing, so the hit rate only moves through cache pressure: entries are
    reused sooner, so fewer are evicted between uses (hit rate rises or holds)."""
    if factor <= 0:
        raise ValueError(f"time compression factor must be > 0, got {factor}")
    return [replace(r, arrival_s=r.arrival_s / factor) for r in reqs]


def overlay(reqs: list[TraceRequest], copies: int) -> list[TraceRequest]:
    """``copies`` copies of the trace, each with its own cache salt (no sharing
    across copies) and shifted by ``k / copies`` of the mean inter-arrival gap.
    The rate multiplies by ``copies``; the reachable hit rate per copy is the
    original's, but copies compete for the same cache (it falls under pressure)."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    if copies == 1:
        return list(reqs)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    gap = span / max(1, len(reqs) - 1)
    out = [replace(r, request_id=f"{r.request_id}c{k}", salt=f"copy{k}", arrival_s=r.arrival_s + gap * k / copies)
           for k in range(copies) for r in reqs]
    out.sort(key=lambda r: r.arrival_s)
    return out


def swing_rate(reqs: list[TraceRequest], amplitude: float, period_s: float | None = None) -> list[TraceRequest]:
    """The same requests with their arrival times warped so that the arrival rate swings over a
    cosine cycle: ``1 - amplitude * cos(2 pi t / period)`` times the original's from the first
    arrival (a trough first, the peak at half a period). Over whole periods the mean rate is the
    original's; order, lengths and sharing are untouched, so on a trace whose rate is level (the
    Mooncake conversation trace: prompt tokens/s within 7% of its mean per 5 minutes, benchmarks/trace_rate_profile.py) it gives a load that rises and falls (peak /
    trough = (1 + a) / (1 - a)) with the trace's own requests. ``period_s`` defaults to the arrivals'
    span (one cycle). ``amplitude`` 0 returns the requests as they are."""
    if not 0.0 <= amplitude < 1.0:
        raise ValueError(f"rate swing amplitude must be in [0, 1) (the trough's rate is 1 - amplitude "
                         f"of the mean), got {amplitude}")
    if period_s is not None and period_s <= 0:
        raise ValueError(f"rate swing period must be > 0 s, got {period_s}")
    if amplitude == 0.0 or len(reqs) < 2:
        return list(reqs)
    t0 = min(r.arrival_s for r in reqs)
    u = np.array([r.arrival_s - t0 for r in reqs], dtype=np.float64)
    period = float(u.max()) if period_s is None else period_s
    if period <= 0:
        raise ValueError("rate swing period must be > 0 s: the arrivals span no time, give a period")
    w = 2.0 * math.pi / period
    # new time tau solves tau - (a / w) sin(w tau) = u: increasing in tau (slope 1 - a cos >= 1 - a > 0)
    lo, hi = u - amplitude / w, u + amplitude / w
    for _ in range(60):
        mid = (lo + hi) / 2.0
        below = mid - amplitude / w * np.sin(w * mid) < u
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    tau = np.maximum.accumulate(np.maximum((lo + hi) / 2.0, 0.0))     # no rounding below 0 or out of order
    return [replace(r, arrival_s=t0 + float(t)) for r, t in zip(reqs, tau)]


class Prompt(NamedTuple):
    tokens: TokenBytes         # reads like list[int]; unpacked only where read
    hashes: list[int]          # pdserve's chained block hashes (full blocks)
    packed: bytes              # the tokens as native uint32 (engine.block_hash.packed_tokens)
    blocks: tuple[bytes, ...]  # ``packed`` cut into full blocks (Request.prompt_blocks; shared by copies)


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class PromptBuilder:
    """Tokens and block hashes of trace prompts (deterministic, memoised).

    Token ids default to [0, 256): CPython shares those int objects, so the
    millions of tokens the simulated prefix caches hold cost 8 bytes each.
    Hashing passes packed uint32 bytes to `packed_block_hashes` (same bytes, same
    hashes as a list, without the per-call list conversion)."""

    def __init__(self, block_size: int, tokens_per_id: int = MOONCAKE_TOKENS_PER_ID,
                 vocab_size: int = 256, first_token: int = 0, seed: int = 0,
                 cache_entries: int = 1 << 16) -> None:
        if block_size < 1 or tokens_per_id % block_size:
            raise ValueError(f"block_size {block_size} must divide tokens_per_id {tokens_per_id} "
                             "(e.g. 16, 64 or 512 for Mooncake traces) so equal hash ids give equal blocks")
        if vocab_size - first_token < 2:
            raise ValueError("vocab_size must leave at least 2 token ids above first_token")
        self.block_size, self.tokens_per_id = block_size, tokens_per_id
        self.vocab_size, self.first_token, self.seed = vocab_size, first_token, seed
        self._id_tokens: dict[int, np.ndarray] = {}
        self._cache_entries = cache_entries
        # a prompt's packed tokens (and its blocks) by (hash ids, length): overlaid copies of one
        # trace request arrive within one inter-arrival gap and differ only in salt (their hashes),
        # so all but the first reuse the bytes (and share them in memory, in every node's prefix
        # cache too); at most 1024 prompts
        self._prompts: dict[tuple[tuple[int, ...], int], tuple[bytes, tuple[bytes, ...]]] = {}
        self._offsets = np.arange(tokens_per_id, dtype=np.uint64)

    def _mix(self, ids: np.ndarray) -> np.ndarray:
        base = ((ids.astype(np.uint64) * np.uint64(0x10001) + np.uint64(self.seed * 0x9E3779B1))
                & np.uint64(0xFFFFFFFFFFFF)) << np.uint64(16)
        mixed = _splitmix(base[:, None] + self._offsets[None, :])
        return (mixed % np.uint64(self.vocab_size - self.first_token)) + np.uint64(self.first_token)

    def id_tokens(self, hash_id: int) -> list[int]:
        """The ``tokens_per_id`` tokens of one hash id (seeded by the id)."""
        return self._mix(np.asarray([hash_id])).ravel().astype(np.int64).tolist()

    def _flat(self, req: TraceRequest) -> np.ndarray:
        """The prompt's tokens as uint32: each id's tokens memoised (overlaid copies and
        conversation turns repeat ids; the salt changes hashes, not tokens)."""
        ids = req.hash_ids[:-(-req.input_length // self.tokens_per_id)]
        memo = self._id_tokens
        missing = list(dict.fromkeys(h for h in ids if h not in memo))
        if missing:
            if len(memo) + len(missing) > self._cache_entries // 4:      # <= 32 MB at 512 tokens per id
                memo.clear()
                missing = list(dict.fromkeys(ids))
            for h, row in zip(missing, self._mix(np.asarray(missing, dtype=np.int64)).astype(np.uint32)):
                memo[h] = row
        return np.concatenate([memo[h] for h in ids])[:req.input_length] if ids else np.zeros(0, np.uint32)

    def tokens(self, req: TraceRequest) -> list[int]:
        """The prompt: each id's tokens in order, cut to ``input_length``."""
        return self._flat(req).tolist()

    def prompt(self, req: TraceRequest) -> Prompt:
        """``tokens(req)`` (as `TokenBytes`: equal to the list, never unpacked by
        the simulated engines), ``hashes(req, tokens)`` and the packed tokens at
        once (hashing and the engine's prefix cache take the numpy bytes directly)."""
        key = (req.hash_ids, req.input_length)
        memo = self._prompts.get(key)
        if memo is None:
            if len(self._prompts) >= 1024:
                self._prompts.clear()
            packed = self._flat(req).tobytes()
            memo = self._prompts[key] = packed, cut_blocks(packed, self.block_size)
        packed, blocks = memo
        hashes = packed_block_hashes(packed, self.block_size, root_hash(req.salt))
        return Prompt(TokenBytes(packed), hashes, packed, blocks)

    def hashes(self, req: TraceRequest, tokens: list[int]) -> list[int]:
        """pdserve's chained hashes of every full block of the prompt."""
        return packed_block_hashes(packed_tokens(tokens), self.block_size, root_hash(req.salt))

"""Workloads of benchmarks/routing.py: shared-prefix groups, and a replay of the
Mooncake conversation trace scaled to a small machine.

The Mooncake replay keeps whole conversations: a request belongs to the
conversation of the earlier request it shares the longest prefix with (at
least two hash ids; id 0, a system block every request starts with, does not
make a conversation). ``conversations`` of them are drawn at random (seeded)
over the whole hour and every turn of each is kept, so the trace's reuse
(turn k+1 extends turn k) survives the sampling; the first N rows of the
trace alone would not show it (ideal hit rate 0.06 for the first 200 rows,
0.37 over the whole trace). Lengths are scaled by ``block_len / 512`` (each
hash id becomes ``block_len`` deterministic tokens, as `pdserve bench` does)
and the timestamps by ``time_scale``.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from cluster.tools.bench import datasets as ds

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


@dataclass(frozen=True)
class MooncakeSample:
    path: str = str(DEFAULT_TRACE)
    conversations: int = 60
    block_len: int = 16             # tokens per hash id (512 in the trace)
    time_scale: float = 1 / 40      # trace seconds -> replay seconds
    max_len: int = 1536             # cap on a prompt's tokens after scaling
    output_len: int = 4             # cap on output tokens (prefill is what routing changes)
    seed: int = 0
    min_turns: int = 1              # draw only among conversations of at least this many turns


def read_rows(path: str) -> list[dict]:
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--trace-path {path}: cannot read a Mooncake JSONL trace ({e}); "
                         "see ../shared/traces/mooncake/README.md") from e


def conversations(rows: list[dict]) -> list[list[int]]:
    """Row indices grouped by conversation, in trace order."""
    owner: dict[tuple[int, ...], int] = {}
    convs: list[list[int]] = []
    for i, row in enumerate(rows):
        ids, found = tuple(int(h) for h in row["hash_ids"]), None
        for k in range(len(ids), 1, -1):
            found = owner.get(ids[:k])
            if found is not None:
                break
        if found is None:
            found = len(convs)
            convs.append([])
        convs[found].append(i)
        for k in range(2, len(ids) + 1):
            owner.setdefault(ids[:k], found)
    return convs


def pick_conversations(rows: list[dict], n: int, seed: int, min_turns: int = 1) -> list[int]:
    """The row indices of ``n`` conversations drawn at random (seeded) among those of at least
    ``min_turns`` turns, every turn of each kept, in trace order. ``min_turns`` 1 draws among all
    of them (the trace's mix: 5,114 of its 7,373 conversations are one turn); more draws the
    multi-turn chats, whose later turns extend the earlier ones (benchmarks/mooncake_conversations.py
    gives the counts and each class's ideal hit rate)."""
    if min_turns < 1:
        raise ValueError(f"--min-turns must be >= 1, got {min_turns}")
    convs = [c for c in conversations(rows) if len(c) >= min_turns]
    if not 1 <= n <= len(convs):
        raise ValueError(f"--conversations must be in [1, {len(convs)}] (the conversations of at least "
                         f"{min_turns} turns), got {n}")
    return sorted(i for c in random.Random(seed).sample(convs, n) for i in c)


def mooncake_dataset(spec: MooncakeSample, vocab_size: int) -> list[ds.BenchRequest]:
    """The sampled conversations' requests in trace order, each with its arrival_s."""
    rows = read_rows(spec.path)
    picked = pick_conversations(rows, spec.conversations, spec.seed, spec.min_turns)
    t0, out = float(rows[picked[0]]["timestamp"]), []
    scale = spec.block_len / ds.TRACE_BLOCK_TOKENS
    for i in picked:
        row = rows[i]
        length = min(max(1, round(int(row["input_length"]) * scale)), spec.max_len)
        tokens: list[int] = []
        for h in row["hash_ids"]:
            if len(tokens) >= length:
                break
            tokens.extend(ds.hash_block_tokens(int(h), spec.block_len, vocab_size))
        if len(tokens) < length:     # ids that do not cover the input: row-unique padding
            tokens.extend(ds.hash_block_tokens(-(i + 2), length - len(tokens), vocab_size))
        out_len = min(max(1, round(int(row["output_length"]) * scale)), spec.output_len)
        out.append(ds.BenchRequest(tuple(tokens[:length]), out_len, prompt_len=length,
                                   arrival_s=(float(row["timestamp"]) - t0) / 1000.0 * spec.time_scale))
    return out

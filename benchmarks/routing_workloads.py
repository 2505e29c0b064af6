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


def mooncake_dataset(spec: MooncakeSample, vocab_size: int) -> list[ds.BenchRequest]:
    """The sampled conversations' requests in trace order, each with its arrival_s."""
    rows = read_rows(spec.path)
    convs = conversations(rows)
    if not 1 <= spec.conversations <= len(convs):
        raise ValueError(f"--conversations must be in [1, {len(convs)}], got {spec.conversations}")
    picked = sorted(i for c in random.Random(spec.seed).sample(convs, spec.conversations) for i in c)
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

"""What `pdserve bench` sends: random, shared-prefix, ShareGPT and Mooncake-trace workloads.

Every generator is seeded and returns a list of `BenchRequest`. Synthetic
prompts are token ids (sent as `prompt_token_ids`, no tokenizer needed);
ShareGPT prompts are text (the server tokenizes them).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

TRACE_BLOCK_TOKENS = 512     # Mooncake hash ids each stand for 512 tokens
_HASH_ID_SEED = 0x6D6F6F6E   # fixed: equal hash ids give equal tokens in every run


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...] | None
    output_len: int
    prompt: str | None = None
    prompt_len: int = 0                  # tokens (estimated for text prompts)
    cache_salt: str = ""
    arrival_s: float | None = None       # from a trace; None = the arrival process decides

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("a BenchRequest needs exactly one of prompt or prompt_token_ids")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")


@dataclass(frozen=True)
class RandomSpec:
    input_len: int = 128
    output_len: int = 32
    range_ratio: float = 0.0             # lengths uniform in [L*(1-r), L*(1+r)]


@dataclass(frozen=True)
class SharedPrefixSpec:
    groups: int = 4
    prompts_per_group: int = 8
    system_len: int = 256                # shared by a group (and tenant)
    question_len: int = 32               # unique per prompt
    output_len: int = 16
    tenants: int = 1                     # >1: prompts take turns among tenants, each its own cache salt


@dataclass(frozen=True)
class TraceSpec:
    block_len: int = TRACE_BLOCK_TOKENS  # tokens per hash id; < 512 scales every length down
    time_scale: float = 1.0              # arrival = timestamp_ms / 1000 * time_scale
    max_len: int = 0                     # cap input tokens after scaling (0 = no cap)
    max_output_len: int = 0              # cap output tokens after scaling (0 = no cap)


def token_range(vocab_size: int) -> tuple[int, int]:
    """[low, high) of ids for synthetic prompts, clear of the special tokens at the bottom."""
    if vocab_size < 16:
        raise ValueError(f"vocab_size {vocab_size} is too small for synthetic prompts (need >= 16)")
    return min(1000, max(3, vocab_size // 8)), vocab_size


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int, name: str) -> np.ndarray:
    if mean < 1:
        raise ValueError(f"{name} must be >= 1, got {mean}")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n)


def random_dataset(spec: RandomSpec, n: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    """Uniformly random tokens; input and output lengths uniform around their means."""
    rng = np.random.default_rng(seed)
    lo, hi = token_range(vocab_size)
    ins = _lengths(rng, spec.input_len, spec.range_ratio, n, "--random-input-len")
    outs = _lengths(rng, spec.output_len, spec.range_ratio, n, "--random-output-len")
    return [BenchRequest(tuple(int(t) for t in rng.integers(lo, hi, size=int(i))), int(o), prompt_len=int(i))
            for i, o in zip(ins, outs)]


def shared_prefix_dataset(spec: SharedPrefixSpec, vocab_size: int, seed: int) -> list[BenchRequest]:
    """groups x prompts_per_group prompts: a group's system prompt + a unique question, shuffled."""
    for name in ("groups", "prompts_per_group", "system_len", "question_len", "output_len", "tenants"):
        if getattr(spec, name) < 1:
            flag = "--sp-" + name.replace("_", "-")
            raise ValueError(f"{flag} must be >= 1, got {getattr(spec, name)}")
    rng = np.random.default_rng(seed)
    lo, hi = token_range(vocab_size)
    out = []
    for _ in range(spec.groups):
        system = tuple(int(t) for t in rng.integers(lo, hi, size=spec.system_len))
        for _ in range(spec.prompts_per_group):
            question = tuple(int(t) for t in rng.integers(lo, hi, size=spec.question_len))
            out.append((system + question, spec.output_len))
    order = rng.permutation(len(out))
    salt = (lambda i: f"bench-tenant-{i % spec.tenants}") if spec.tenants > 1 else (lambda i: "")
    return [BenchRequest(out[j][0], out[j][1], prompt_len=len(out[j][0]), cache_salt=salt(k))
            for k, j in enumerate(order)]


def sharegpt_dataset(path: str | Path, n: int, encode: Callable[[str], Sequence[int]], seed: int,
                     max_len: int = 0) -> list[BenchRequest]:
    """First human turn as the prompt, the following reply's token count as the output length."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--sharegpt-path {path}: cannot read a JSON list of conversations ({e})") from e
    if not isinstance(data, list):
        raise ValueError(f"--sharegpt-path {path}: expected a JSON list of {{'conversations': [...]}} objects")
    pairs = []
    for item in data:
        conv = item.get("conversations") if isinstance(item, dict) else None
        if isinstance(conv, list) and len(conv) >= 2 and all(isinstance(t, dict) for t in conv[:2]):
            pairs.append((str(conv[0].get("value", "")), str(conv[1].get("value", ""))))
    rng = np.random.default_rng(seed)
    out = []
    for i in rng.permutation(len(pairs)):
        prompt, reply = pairs[i]
        p_len, o_len = len(encode(prompt)), len(encode(reply))
        if p_len < 4 or o_len < 4 or (max_len and p_len + o_len > max_len):
            continue   # too short to time, or too long for the server (same filter as vLLM's bench)
        out.append(BenchRequest(None, o_len, prompt=prompt, prompt_len=p_len))
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"--sharegpt-path {path}: no usable conversations (need a human turn and a "
                         "reply of >= 4 tokens each, within --sharegpt-max-len)")
    return out


def hash_block_tokens(hash_id: int, block_len: int, vocab_size: int) -> tuple[int, ...]:
    """The deterministic tokens standing for one trace hash id (equal ids -> equal tokens)."""
    lo, hi = token_range(vocab_size)
    rng = np.random.default_rng([_HASH_ID_SEED, int(hash_id)])
    return tuple(int(t) for t in rng.integers(lo, hi, size=block_len))


def trace_dataset(path: str | Path, n: int, spec: TraceSpec, vocab_size: int) -> list[BenchRequest]:
    """The first n rows of a Mooncake trace, lengths scaled by block_len / 512, arrivals by time_scale."""
    if not 1 <= spec.block_len <= TRACE_BLOCK_TOKENS:
        raise ValueError(f"--trace-block-len must be in [1, {TRACE_BLOCK_TOKENS}], got {spec.block_len}")
    if spec.time_scale <= 0:
        raise ValueError(f"--trace-time-scale must be > 0 (0.1 = ten times faster), got {spec.time_scale}")
    scale = spec.block_len / TRACE_BLOCK_TOKENS
    out: list[BenchRequest] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--trace-path {path}: cannot read it ({e})") from e
    t0 = None
    for lineno, line in enumerate(lines, 1):
        if len(out) == n:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ts, in_len, out_len = float(row["timestamp"]), int(row["input_length"]), int(row["output_length"])
            hash_ids = [int(h) for h in row.get("hash_ids", [])]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"--trace-path {path}:{lineno}: expected a JSON object with timestamp, "
                             f"input_length, output_length and hash_ids ({e})") from e
        t0 = ts if t0 is None else t0
        length = max(1, round(in_len * scale))
        if spec.max_len:
            length = min(length, spec.max_len)
        tokens: list[int] = []
        for h in hash_ids:
            if len(tokens) >= length:
                break
            tokens.extend(hash_block_tokens(h, spec.block_len, vocab_size))
        if len(tokens) < length:   # rows whose hash ids do not cover the input: pad with row-unique tokens
            tokens.extend(hash_block_tokens(-(lineno + 1), length - len(tokens), vocab_size))
        o_len = max(1, round(out_len * scale))
        if spec.max_output_len:
            o_len = min(o_len, spec.max_output_len)
        out.append(BenchRequest(tuple(tokens[:length]), o_len, prompt_len=length,
                                arrival_s=(ts - t0) / 1000.0 * spec.time_scale))
    if not out:
        raise ValueError(f"--trace-path {path}: no requests in the trace")
    return out


def ideal_prefix_hit_rate(requests: Sequence[BenchRequest], block_size: int) -> float:
    """Cached / prompt tokens with one infinite prefix cache, requests in order: a full block
    hits when the same salt and the same tokens up to its end were seen before (at most
    len - 1 tokens per prompt, as the engine always computes the last one)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen: set[int] = set()
    cached = total = 0
    for r in requests:
        if r.prompt_token_ids is None:
            raise ValueError("ideal_prefix_hit_rate needs token-id prompts (not ShareGPT text)")
        ids = r.prompt_token_ids
        total += len(ids)
        key = hash(r.cache_salt)
        hits, missed = 0, False
        for b in range(len(ids) // block_size):
            key = hash((key, ids[b * block_size:(b + 1) * block_size]))
            if not missed and key in seen:
                hits += 1
            else:
                missed = True
                seen.add(key)
        cached += min(hits * block_size, max(0, len(ids) - 1))
    return cached / total if total else 0.0

"""The live prefix working set of routing.py's Mooncake replay, and what a KV cache of a given size keeps of it.

Offline, from the trace alone (no cluster, seconds): the same sample as
``routing.py --workload mooncake`` (routing_workloads.mooncake_dataset, same
seed, block length, cap), cut into the engine's 16-token blocks and chained
as the prefix cache keys them (datasets.ideal_prefix_hit_rate's rule).

- ``working_set_blocks``: at time t, the distinct blocks computed by a request
  sent at or before t that a request sent after t hits under one infinite
  cache: what a cache must hold at t to reach the ideal hit rate. Its peak and
  its time-weighted mean over the arrivals; ``per_worker_sticky``: the same
  per worker when every conversation stays on the worker its first turn went
  to (first turns to the worker with the fewest tokens so far).
- ``lru_model``: a model of each policy's prefill hit rate at each --kv-blocks
  value: round_robin sends request i to worker i mod n, sticky keeps
  conversations as above; each worker an LRU over blocks, a request's blocks
  made most recent tail first (its first block evicted last, as the engine
  frees them). It ignores the blocks of requests in flight and the queues, so
  it is an estimate, not a measurement.

    .venv/bin/python benchmarks/mooncake_working_set.py --conversations 120 --kv-blocks 512,1024,2048

Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import random
from collections import OrderedDict
from typing import Sequence

from cluster.tools.bench import datasets as ds
from routing_workloads import DEFAULT_TRACE, MooncakeSample, conversations, mooncake_dataset, read_rows

BLOCK = 16                  # the engine's KV block (ServeConfig.block_size)
VOCAB = 49152               # SmolLM2's vocabulary: the token ids do not change which blocks repeat


def block_keys(ids: Sequence[int], block: int = BLOCK) -> list[int]:
    """The chained keys of a prompt's full blocks (equal keys: equal tokens up to that block's end)."""
    key, out = hash(None), []
    for b in range(len(ids) // block):
        key = hash((key, tuple(ids[b * block:(b + 1) * block])))
        out.append(key)
    return out


def live_intervals(keys: list[list[int]], times: list[float]) -> dict[int, tuple[float, float]]:
    """Per block reused at least once: (time first computed, time of its last hit)."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for ks, t in zip(keys, times):
        for k in ks:
            if k in first:
                last[k] = t
            else:
                first[k] = t
    return {k: (first[k], last[k]) for k in last}


def working_set(intervals: dict[int, tuple[float, float]], span: float) -> dict[str, float]:
    """Peak and time-weighted mean of the blocks live at once over [0, span]."""
    events = sorted([(a, 1) for a, _ in intervals.values()] + [(b, -1) for _, b in intervals.values()],
                    key=lambda e: (e[0], -e[1]))
    live = peak = 0
    area, prev = 0.0, 0.0
    for t, d in events:
        area += live * (t - prev)
        prev, live = t, live + d
        peak = max(peak, live)
    return {"peak": peak, "mean": round(area / span, 1) if span > 0 else float(peak)}


def sticky_workers(convs: list[int], lengths: list[int], n: int) -> list[int]:
    """A worker per request: a conversation's first turn to the worker with the fewest tokens so far."""
    home: dict[int, int] = {}
    tokens = [0] * n
    out = []
    for c, length in zip(convs, lengths):
        if c not in home:
            home[c] = min(range(n), key=lambda w: (tokens[w], w))
        tokens[home[c]] += length
        out.append(home[c])
    return out


def lru_hit_rate(keys: list[list[int]], lengths: list[int], workers: list[int], capacity: int) -> float:
    """Hit / prompt tokens with one LRU of ``capacity`` blocks per worker (at most len - 1 tokens per prompt)."""
    caches: dict[int, OrderedDict[int, None]] = {}
    hit = 0
    for ks, length, w in zip(keys, lengths, workers):
        cache = caches.setdefault(w, OrderedDict())
        n = 0
        while n < len(ks) and ks[n] in cache:
            n += 1
        hit += min(n * BLOCK, max(0, length - 1))
        for k in reversed(ks):
            cache[k] = None
            cache.move_to_end(k)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hit / sum(lengths)


def sample_conversations(spec: MooncakeSample) -> list[int]:
    """The conversation of each request of mooncake_dataset(spec), in its order."""
    convs = conversations(read_rows(spec.path))
    picked = random.Random(spec.seed).sample(convs, spec.conversations)
    conv_of = {i: n for n, c in enumerate(picked) for i in c}
    return [conv_of[i] for i in sorted(conv_of)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace-path", default=str(DEFAULT_TRACE))
    p.add_argument("--conversations", type=int, default=120)
    p.add_argument("--trace-block-len", type=int, default=64)
    p.add_argument("--trace-time-scale", type=float, default=0.1)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-workers", type=int, default=4)
    p.add_argument("--kv-blocks", default="256,512,768,1024,1536,2048,4096")
    args = p.parse_args()
    spec = MooncakeSample(args.trace_path, args.conversations, args.trace_block_len, args.trace_time_scale,
                          args.max_model_len - args.output_len, args.output_len, args.seed)
    reqs = mooncake_dataset(spec, VOCAB)
    convs = sample_conversations(spec)
    if len(convs) != len(reqs):
        raise ValueError("the sample's conversations do not match its requests; routing_workloads changed?")
    times = [r.arrival_s or 0.0 for r in reqs]
    keys = [block_keys(r.prompt_token_ids or ()) for r in reqs]
    lengths = [len(r.prompt_token_ids or ()) for r in reqs]
    n = args.prefill_workers
    sticky = sticky_workers(convs, lengths, n)
    intervals = live_intervals(keys, times)
    span = max(times)
    per_worker = []
    for w in range(n):
        mine = [i for i, s in enumerate(sticky) if s == w]
        per_worker.append(working_set(live_intervals([keys[i] for i in mine], [times[i] for i in mine]), span))
    rr = [i % n for i in range(len(reqs))]
    print(json.dumps({
        "benchmark": "mooncake_working_set", "conversations": args.conversations, "requests": len(reqs),
        "trace_block_len": args.trace_block_len, "trace_time_scale": args.trace_time_scale,
        "engine_block_tokens": BLOCK, "arrivals_over_s": round(span, 1),
        "offered_prompt_tokens": sum(lengths), "offered_rate_per_s": round(len(reqs) / span, 3),
        "ideal_hit_rate": round(ds.ideal_prefix_hit_rate(reqs, BLOCK), 3),
        "working_set_blocks": working_set(intervals, span),
        "per_worker_sticky": per_worker,
        "lru_model": {cap: {"round_robin": round(lru_hit_rate(keys, lengths, rr, cap), 3),
                            "sticky": round(lru_hit_rate(keys, lengths, sticky, cap), 3)}
                      for cap in (int(x) for x in args.kv_blocks.split(","))},
    }))


if __name__ == "__main__":
    main()

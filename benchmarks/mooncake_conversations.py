"""The Mooncake conversation trace's conversations by turns, and what routing can act on in each
class: for conversations of at least K turns, how many there are, their requests, and the ideal
(infinite-cache) hit rate of a replay of all of them, scaled as routing.py replays them (each hash
id ``--trace-block-len`` tokens, prompts capped at ``--max-model-len`` - 4). Backs the choice of
``--min-turns`` in benchmarks/routing.py (issue 26). Prints one JSON line.

    PYTHONPATH=$PWD:$PWD/benchmarks .venv/bin/python benchmarks/mooncake_conversations.py
"""
from __future__ import annotations

import argparse
import json
from collections import Counter

from routing_sim import ideal_hit_rate, mooncake
from routing_workloads import DEFAULT_TRACE, conversations, read_rows


def by_turns(turns: list[int], max_turns: int) -> dict[str, int]:
    """Conversations by their number of turns, the last class counting ``max_turns`` or more."""
    counts = Counter(min(t, max_turns) for t in turns)
    return {(f"{k}+" if k == max_turns else str(k)): counts[k] for k in range(1, max_turns + 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-turns", default="1,2,3,4", help="the classes: conversations of at least K turns")
    ap.add_argument("--trace-block-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args(argv)
    turns = [len(c) for c in conversations(read_rows(str(DEFAULT_TRACE)))]
    classes = {}
    for k in (int(x) for x in args.min_turns.split(",")):
        n = sum(t >= k for t in turns)
        reqs = mooncake(n, 1.0, args.max_model_len - 4, 0, args.trace_block_len, k)
        classes[str(k)] = {"conversations": n, "requests": len(reqs),
                           "ideal_hit_rate": round(ideal_hit_rate(reqs, args.trace_block_len), 3)}
    print(json.dumps({"trace": DEFAULT_TRACE.name, "conversations": len(turns), "by_turns": by_turns(turns, 5),
                      "trace_block_len": args.trace_block_len, "max_prompt_len": args.max_model_len - 4,
                      "at_least_k_turns": classes}))


if __name__ == "__main__":
    main()

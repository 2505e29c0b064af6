"""Where the router's slowest KV-event ingest calls go while its index grows.

The world of router_overhead.py (64 workers, stores until ~1M (worker, block)
entries are indexed), each ``Router.on_events`` call timed, and within it the
C block table's share (``BlockTable.sync``: the mirror of the index's
``_held`` kept in step, and where that table doubles). The rest of a call is
the Python index (its dicts, which grow by resizing in the call that fills
them). Ingest runs on the router's loop, as decisions do, so a slow call holds
the decisions behind it. Prints one JSON line: the call count, p50 / p99 / max
wall, the calls of a millisecond or more, and the slowest calls with their C
share, the index's block count and the C table's bytes at that moment.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/router_ingest.py [--blocks 1000000] [--slowest 10]
"""
from __future__ import annotations

import argparse
import json
import random
import time

from cluster.router import Router, RouterConfig

import router_overhead as ro          # this folder's: the script's own folder is on the path


class _TimedTable:
    """The index's C table with ``sync`` timed; everything else passed through."""

    def __init__(self, table) -> None:
        self._table, self.spent = table, 0.0

    def sync(self, hashes, held) -> None:
        t0 = time.perf_counter()
        try:
            self._table.sync(hashes, held)
        finally:
            self.spent += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._table, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1_000_000, help="(worker, block) entries to index")
    ap.add_argument("--slowest", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    world = ro.default_world(args.blocks)
    router = Router(RouterConfig(policy="prefix_aware"), rng=random.Random(args.seed + 1), clock=time.monotonic)
    index = router.index
    table = index.native_table
    timed = _TimedTable(table) if table is not None else None
    if timed is not None:
        index._native = timed
    calls: list[tuple[float, float, int, int]] = []      # wall s, C table s, blocks held, C table bytes
    on_events = router.on_events

    def on_events_timed(worker_id, events):
        c0 = timed.spent if timed else 0.0
        t0 = time.perf_counter()
        result = on_events(worker_id, events)
        wall = time.perf_counter() - t0
        calls.append((wall, (timed.spent - c0) if timed else 0.0, len(index._held), table.nbytes() if table else 0))
        return result

    router.on_events = on_events_timed                  # type: ignore[method-assign]
    ro.build(world, router, random.Random(args.seed))
    walls = sorted(c[0] for c in calls)
    slowest = sorted(calls, reverse=True)[:args.slowest]
    print(json.dumps({
        "bench": "router_ingest", "calls": len(calls), "native_table": table is not None,
        "call_p50_us": round(ro.pct(walls, 0.5) * 1e6, 1), "call_p99_us": round(ro.pct(walls, 0.99) * 1e6, 1),
        "call_max_ms": round(walls[-1] * 1e3, 2), "calls_over_1ms": sum(1 for w in walls if w >= 1e-3),
        "slowest": [{"wall_ms": round(w * 1e3, 2), "c_table_ms": round(c * 1e3, 2), "blocks_held": held,
                     "c_table_mb": round(nb / 2**20, 1)} for w, c, held, nb in slowest],
    }))


if __name__ == "__main__":
    main()

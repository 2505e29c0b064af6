"""Routing decision overhead with 64 simulated workers and ~1M indexed blocks.

Feeds the real `Router` / `PrefixIndex` with synthetic KV events (shared
system prompts held by many workers, per-worker conversations extending them,
tail-first eviction once a worker's cache is full), then times `route()` for
many 2000-token prompts. The prompt's block hashes are timed apart: the
frontend computes them once, outside the router.

    .venv/bin/python benchmarks/router_overhead.py [--workers 64] [--blocks 1000000]
    .venv/bin/python benchmarks/router_overhead.py --compare-tree /path/to/other/checkout

``--compare-tree`` runs this script in fresh processes, alternating the router
of that checkout ("before": its cluster/ and engine/ first on the path) with
this one's ("after"), ``--rounds`` times each, and prints one JSON line with
every run's figures and the median of each side.

Prints one JSON line: decision p50/p99 (wall: also p99.9, max, mean and the
decisions of a millisecond or more) in microseconds of wall time and of
thread CPU time (the CPU figure leaves out time the OS gave other processes,
which dominates wall p99 on a shared machine; ``loadavg_1m`` says how shared),
hash p50/p99, event ingest rate and the wall time of one ingest call (``on_events``
for one store: p99, max and the calls of a millisecond or more, which run on the
router's loop as decisions do), index size and memory (tracemalloc of an
identical index, hash ints included), and the in-flight prefixes left at the end
(entries, and the C table's slot arrays in MB: both generations and a next array
made ready for the current one; None where the dicts hold them).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections import Counter, deque

from cluster.router import (CostWeights, PolicyConfig, PrefixIndex, Router, RouterConfig, RoutingRequest,
                            WorkerLoad)
from engine.block_hash import block_hashes, root_hash
from engine.kv_events import KVEvent, KVEventKind, Tier


ROOT = root_hash(None)         # the parent of a prompt's first block


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class SimWorker:
    """One worker's cache as the benchmark imagines it: conversations (chains
    of block hashes) in LRU order, evicted tail first when over capacity."""

    def __init__(self, wid: str, capacity: int) -> None:
        self.wid = wid
        self.capacity = capacity
        self.next_id = 1
        self.held: set[int] = set()
        self.convs: deque[list[int]] = deque()
        self.systems: set[int] = set()

    def store(self, chain: list[int], new_from: int, tier: Tier = Tier.DEVICE) -> list[KVEvent]:
        """STORED events as the engine sends them: one per run of new blocks, with the
        parent of its first block (engine/kv_events.py ``stored_chains``)."""
        fresh = tuple(h for h in chain[new_from:] if h not in self.held)
        events = []
        parents = [ROOT] + chain[:-1]
        run: list[int] = []
        for i in range(new_from, len(chain) + 1):
            if i < len(chain) and chain[i] not in self.held:
                run.append(chain[i])
                continue
            if run:
                events.append(self._event(KVEventKind.STORED, tuple(run), tier, parents[i - len(run)]))
                run = []
        if fresh:
            self.held.update(fresh)
            self.convs.append(list(fresh))
        while len(self.held) > self.capacity and self.convs:
            victim = self.convs.popleft()
            gone = tuple(reversed([h for h in victim if h in self.held]))
            self.held.difference_update(gone)
            if gone:
                events.append(self._event(KVEventKind.REMOVED, gone, Tier.DEVICE))
        return events

    def _event(self, kind: KVEventKind, hashes: tuple[int, ...], tier: Tier,
               parent: int | None = None) -> KVEvent:
        ev = KVEvent(self.next_id, kind, hashes, parent, tier)
        self.next_id += 1
        return ev


def default_world(blocks: int = 1_000_000) -> argparse.Namespace:
    """This script's defaults (its world: 64 workers of 20,000 blocks, 400 shared system prompts,
    2,000-token prompts) with ``blocks`` indexed, as ``build`` and ``make_prompt`` read them."""
    return parser().parse_args(["--blocks", str(blocks)])


def build(args, router: Router, rng: random.Random) -> dict:
    bs = args.block_size
    sys_tokens = [[s * 1_000_003 + t for t in range(args.system_blocks * bs)] for s in range(args.systems)]
    sys_hashes = [block_hashes(t, bs) for t in sys_tokens]
    popularity = [1.0 / (s + 1) for s in range(args.systems)]            # Zipf-like
    workers = [SimWorker(f"w{i:03d}", args.capacity) for i in range(args.workers)]
    convs: list[tuple[int, list[int], list[int]]] = []                     # (system, tokens, hashes)
    log: list[tuple[str, list[KVEvent]]] = []                              # every event, for index_bytes
    ingest_s = 0.0
    ingest_calls: list[float] = []                                         # each on_events call's wall s
    n_events = n_blocks = 0
    base = 10**9
    rss0 = rss_bytes()
    while router.index.num_entries < args.blocks:
        w = rng.choice(workers)
        s = rng.choices(range(args.systems), popularity)[0]
        n_new = rng.randint(8, 90)
        tokens = list(range(base, base + n_new * bs))
        base += n_new * bs
        chain = sys_hashes[s] + block_hashes(tokens, bs, parent=sys_hashes[s][-1])
        tier = Tier.HOST if rng.random() < args.host_share else Tier.DEVICE
        events = w.store(chain, 0, tier)
        if len(convs) < 20000:
            convs.append((s, tokens, chain))
        t0 = time.perf_counter()
        res = router.on_events(w.wid, events)
        ingest_calls.append(time.perf_counter() - t0)
        ingest_s += ingest_calls[-1]
        log.append((w.wid, events))
        assert not res.needs_resync, res
        n_events += len(events)
        n_blocks += sum(len(e.block_hashes) for e in events)
    gc.collect()
    return {"workers_sim": workers, "sys_tokens": sys_tokens, "convs": convs, "log": log,
            "ingest_events_per_s": round(n_events / ingest_s), "ingest_blocks_per_s": round(n_blocks / ingest_s),
            "ingest_call_p99_us": round(pct(ingest_calls, 0.99) * 1e6, 1),
            "ingest_call_max_us": round(max(ingest_calls) * 1e6, 1),
            "ingest_calls_over_1ms": sum(1 for x in ingest_calls if x >= 1e-3),
            "events": n_events, "index_rss_mb": round((rss_bytes() - rss0) / 2**20, 1)}


def make_prompt(args, world: dict, rng: random.Random, i: int) -> list[int]:
    bs = args.block_size
    if rng.random() < 0.5 and world["convs"]:                             # a follow-up turn
        s, tokens, _ = rng.choice(world["convs"])
        prompt = world["sys_tokens"][s] + tokens
    else:                                                                  # a new question
        s = rng.choices(range(args.systems), [1.0 / (k + 1) for k in range(args.systems)])[0]
        prompt = list(world["sys_tokens"][s])
    fill = args.prompt_tokens - len(prompt)
    return prompt[:args.prompt_tokens] + [7 * i + t for t in range(max(0, fill))]


def index_bytes(log: list[tuple[str, list[KVEvent]]]) -> int:
    """Bytes a PrefixIndex fed the same events allocates (tracemalloc), hash ints
    included: the event log replayed with fresh copies of the hashes."""
    def fresh(h: int | None) -> int | None:
        return None if h is None else int.from_bytes(h.to_bytes(8, "little"), "little")

    tracemalloc.start()
    copy = PrefixIndex()
    for wid, events in log:
        copy.apply(wid, [KVEvent(e.event_id, e.kind, tuple(map(fresh, e.block_hashes)), fresh(e.parent_hash), e.tier)
                         for e in events])
    copy.match([0])
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return used


def prehash(args, world: dict, rng: random.Random) -> list[tuple[list[int], tuple[int, ...], int, int]]:
    """Every prompt and its hashes made before the first decision (``--prehash``):
    route() then runs without the hashing's cache traffic just before it."""
    out = []
    for i in range(args.decisions):
        prompt = make_prompt(args, world, rng, i)
        t0 = time.perf_counter_ns()
        hashes = tuple(block_hashes(prompt, args.block_size, None))
        out.append((prompt, hashes, t0, time.perf_counter_ns()))
    return out


class VirtualClock:
    """The router's clock: requests arrive ``--interval-s`` apart whatever the
    machine's speed, so optimistic load and in-flight entries lapse at the same
    decisions in every run (with the wall clock, a loaded machine changed them)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--prefill-share", type=float, default=0.5, help="share of workers in the prefill pool")
    ap.add_argument("--blocks", type=int, default=1_000_000, help="(worker, block) entries to index")
    ap.add_argument("--capacity", type=int, default=20_000, help="blocks per worker before eviction")
    ap.add_argument("--systems", type=int, default=400, help="shared system prompts")
    ap.add_argument("--system-blocks", type=int, default=32)
    ap.add_argument("--host-share", type=float, default=0.1, help="share of stores at the host tier")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--decisions", type=int, default=20000)
    ap.add_argument("--policy", default="prefix_aware")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--min-hit-share", type=float, default=0.0,
                    help="CostWeights.min_hit_share (a prefill node's hit under this share of the prompt counts as none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interval-s", type=float, default=0.0002,
                    help="router clock time between two decisions (a virtual clock: runs are repeatable)")
    ap.add_argument("--prehash", action="store_true",
                    help="make every prompt and its hashes first, then route them (other decisions than without)")
    ap.add_argument("--track-in-flight", type=int, choices=(0, 1), default=None,
                    help="RouterConfig.track_in_flight (default: RouterConfig's default)")
    ap.add_argument("--compare-tree", default=None,
                    help="another checkout: run its router and this one side by side (see above)")
    ap.add_argument("--rounds", type=int, default=2, help="with --compare-tree: runs of each side")
    ap.add_argument("--compare-full-scan", action="store_true",
                    help="also time the same prompts with prefix_aware costing every worker (the Python "
                         "policy decides throughout, not the C decider)")
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.workers * args.capacity <= args.blocks:
        ap.error(f"--blocks {args.blocks} (worker, block) entries cannot be indexed: {args.workers} workers "
                 f"hold at most --workers x --capacity = {args.workers * args.capacity}; raise --capacity "
                 f"or --workers, or lower --blocks")
    if args.compare_tree:
        compare(args)
        return

    rng = random.Random(args.seed)
    clock = VirtualClock()
    in_flight = {} if args.track_in_flight is None else {"track_in_flight": bool(args.track_in_flight)}
    pc = PolicyConfig(temperature=args.temperature, weights=CostWeights(min_hit_share=args.min_hit_share))
    router = Router(RouterConfig(policy=args.policy, policy_config=pc,
                                 **in_flight),
                    rng=random.Random(args.seed + 1), clock=clock,
                    **({"native_decisions": False} if args.compare_full_scan else {}))   # the policy's own picks
    n_prefill = int(args.workers * args.prefill_share)
    for i in range(args.workers):
        router.add_worker(f"w{i:03d}", "prefill" if i < n_prefill else "decode")
    world = build(args, router, rng)
    gc.freeze()                                   # long-lived index: keep it out of GC scans

    def report_load(wid: str) -> None:
        router.update_load(wid, WorkerLoad(queued_prefill_tokens=rng.randint(0, 8000),
                                           running=rng.randint(0, 64), waiting=rng.randint(0, 8),
                                           kv_usage=rng.random()))

    for i in range(args.workers):
        report_load(f"w{i:03d}")
    full_scan = {}
    if args.compare_full_scan and args.policy == "prefix_aware":
        # the same decisions costing every worker (the fast pick off), timed first in the same run
        sample_rng = random.Random(args.seed + 2)
        reqs = []
        for i in range(min(args.decisions, 5000)):
            prompt = make_prompt(args, world, sample_rng, i)
            reqs.append(RoutingRequest(f"f{i}", len(prompt), tuple(block_hashes(prompt, args.block_size, None)),
                                       args.block_size))
        for label, min_workers in (("full_scan", 10**9), ("fast", type(router.policy).fast_min_workers)):
            router.policy.fast_min_workers = min_workers
            router.policy.sync(router.view)
            cpu = []
            for r in reqs:
                c0 = time.thread_time_ns()
                router.route(r)
                cpu.append((time.thread_time_ns() - c0) / 1e3)
            full_scan[f"{label}_cpu_p50_us"] = round(pct(cpu, 0.5), 1)
            full_scan[f"{label}_cpu_p99_us"] = round(pct(cpu, 0.99), 1)
        del router.policy.fast_min_workers     # back to the class default
        router.policy.sync(router.view)
    route_us, route_cpu_us, hash_us, kinds, cached = [], [], [], Counter(), []
    digest = hashlib.sha256()                    # every decision: the same digest = the same choices
    load_before = os.getloadavg()[0]
    hashed = prehash(args, world, rng) if args.prehash else None
    for i in range(args.decisions):
        if hashed is not None:
            prompt, hashes, t0, t1 = hashed[i]
        else:
            prompt = make_prompt(args, world, rng, i)
            t0 = time.perf_counter_ns()
            hashes = tuple(block_hashes(prompt, args.block_size, None))
            t1 = time.perf_counter_ns()
        req = RoutingRequest(f"r{i}", len(prompt), hashes, args.block_size)
        c2 = time.thread_time_ns()
        t2 = time.perf_counter_ns()
        d = router.route(req)
        t3 = time.perf_counter_ns()
        c3 = time.thread_time_ns()
        clock.now += args.interval_s
        hash_us.append((t1 - t0) / 1e3)
        route_us.append((t3 - t2) / 1e3)
        route_cpu_us.append((c3 - c2) / 1e3)
        kinds[d.kind.value] += 1
        digest.update(f"{d.decode_worker_id},{d.prefill_worker_id},{d.prefill_cached_tokens},"
                      f"{d.decode_cached_tokens},{d.decode_inputs.cost!r};".encode())
        cached.append(d.prefill_cached_tokens / len(prompt))
        if i % 4 == 0:                            # a load report every few decisions
            report_load(f"w{rng.randrange(args.workers):03d}")

    out = {
        "bench": "router_overhead", "policy": args.policy, "min_hit_share": args.min_hit_share, "workers": args.workers,
        "prefill_workers": n_prefill, "decode_workers": args.workers - n_prefill,
        "indexed_entries": router.index.num_entries, "unique_blocks": router.index.num_unique_blocks,
        "prompt_tokens": args.prompt_tokens, "block_size": args.block_size, "decisions": args.decisions,
        "route_p50_us": round(pct(route_us, 0.50), 1), "route_p99_us": round(pct(route_us, 0.99), 1),
        "route_p999_us": round(pct(route_us, 0.999), 1), "route_max_us": round(max(route_us), 1),
        "route_mean_us": round(sum(route_us) / len(route_us), 1),
        "route_over_1ms": sum(1 for x in route_us if x >= 1000),
        "route_cpu_p50_us": round(pct(route_cpu_us, 0.50), 1), "route_cpu_p99_us": round(pct(route_cpu_us, 0.99), 1),
        "hash_p50_us": round(pct(hash_us, 0.50), 1), "hash_p99_us": round(pct(hash_us, 0.99), 1),
        "ingest_events_per_s": world["ingest_events_per_s"], "ingest_blocks_per_s": world["ingest_blocks_per_s"],
        "ingest_call_p99_us": world["ingest_call_p99_us"], "ingest_call_max_us": world["ingest_call_max_us"],
        "ingest_calls_over_1ms": world["ingest_calls_over_1ms"],
        "events": world["events"], "index_mb": round(index_bytes(world.pop("log")) / 2**20, 1),
        "build_rss_delta_mb": world["index_rss_mb"],
        "in_flight_entries": len(router.in_flight),
        "in_flight_table_mb": (round(table.nbytes() / 2**20, 1)
                               if hasattr(table := getattr(router.in_flight, "table", None), "nbytes") else None),
        "decision_kinds": dict(kinds), "decisions_sha256": digest.hexdigest()[:16], "mean_prefill_hit_ratio": round(sum(cached) / len(cached), 3),
        "target_p99_us": 30, "track_in_flight": router.config.track_in_flight, "prehash": args.prehash, **({"same_prompts_fast_vs_full_scan": full_scan} if full_scan else {}), "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    print(json.dumps(out))


COMPARED = ("route_p50_us", "route_p99_us", "route_p999_us", "route_max_us", "route_mean_us", "route_over_1ms",
            "route_cpu_p50_us", "route_cpu_p99_us", "hash_p50_us",
            "hash_p99_us", "ingest_events_per_s", "ingest_call_p99_us", "ingest_call_max_us",
            "ingest_calls_over_1ms", "index_mb", "mean_prefill_hit_ratio", "decisions_sha256", "decision_kinds")


def compare(args) -> None:
    """Both routers on the same workload in alternating fresh processes."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a in ("--compare-tree", "--rounds"):
            skip = True
        elif not a.startswith(("--compare-tree=", "--rounds=")):
            argv.append(a)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for side, root in (("before", os.path.abspath(args.compare_tree)), ("after", here)):
            env = dict(os.environ, PYTHONPATH=root)
            line = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], env=env, check=True,
                                  capture_output=True, text=True).stdout.strip().splitlines()[-1]
            d = json.loads(line)
            runs[side].append({k: d[k] for k in COMPARED} | {"loadavg_1m": d["loadavg_1m"]}
                              | {k: d.get(k) for k in ("in_flight_entries", "in_flight_table_mb")})
    median = {side: {k: statistics.median(r[k] for r in rs) for k in COMPARED[:-2]} for side, rs in runs.items()}
    same = {r["decisions_sha256"] for rs in runs.values() for r in rs}
    print(json.dumps({"bench": "router_overhead_compare", "before_tree": os.path.abspath(args.compare_tree),
                      "args": argv, "same_decisions": len(same) == 1, "median": median, "runs": runs}))


if __name__ == "__main__":
    main()

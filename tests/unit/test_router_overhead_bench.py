"""benchmarks/router_overhead.py, run small: one JSON line whose decisions repeat
exactly between runs (its virtual clock), with the in-flight prefixes it leaves
counted (entries, and the C table's megabytes) or absent when tracking is off."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from bench_scripts import BENCH

ROOT = BENCH.parent
SMALL = ["--workers", "8", "--blocks", "20000", "--capacity", "5000", "--decisions", "300"]   # capacity x workers > blocks


def run(*extra: str) -> dict:
    out = subprocess.run([sys.executable, str(BENCH / "router_overhead.py"), *SMALL, *extra],
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True, capture_output=True,
                         text=True, timeout=300).stdout.strip().splitlines()
    assert len(out) == 1, out
    return json.loads(out[0])


def test_a_small_run_repeats_its_decisions_and_counts_the_in_flight_table():
    a, b = run(), run()
    assert a["decisions_sha256"] == b["decisions_sha256"]
    assert a["decisions"] == sum(a["decision_kinds"].values()) == 300
    assert a["indexed_entries"] >= 20000 and a["route_p50_us"] > 0
    assert a["track_in_flight"] is True
    # every decision records its prompt's 125 blocks; most are new hashes
    assert 125 * 300 // 2 < a["in_flight_entries"] <= 125 * 300
    if a["in_flight_table_mb"] is not None:       # the C table (None: the dicts, no compiler)
        assert a["in_flight_table_mb"] >= a["in_flight_entries"] * 2 * 24 / 2**20


def test_without_in_flight_tracking_nothing_is_left_in_flight():
    d = run("--track-in-flight", "0")
    assert d["track_in_flight"] is False
    assert d["in_flight_entries"] == 0 and d["in_flight_table_mb"] is None


def test_more_blocks_than_the_workers_can_hold_is_refused_with_the_fix():
    res = subprocess.run([sys.executable, str(BENCH / "router_overhead.py"), "--workers", "4", "--capacity", "100",
                          "--blocks", "1000"], env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and not res.stdout
    assert "--workers x --capacity = 400" in res.stderr and "raise --capacity" in res.stderr


def test_ingest_calls_are_timed_and_the_slowest_split_into_the_c_table_and_the_rest():
    a = run()
    assert 0 < a["ingest_call_p99_us"] <= a["ingest_call_max_us"] and a["ingest_calls_over_1ms"] >= 0
    out = subprocess.run([sys.executable, str(BENCH / "router_ingest.py"), "--blocks", "20000", "--slowest", "3"],
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True, capture_output=True,
                         text=True, timeout=300).stdout.strip().splitlines()
    assert len(out) == 1, out
    d = json.loads(out[0])
    assert d["calls"] > 100 and len(d["slowest"]) == 3
    assert d["call_p50_us"] <= d["call_p99_us"] <= d["call_max_ms"] * 1000 + 10      # (max rounded to 10 us)
    walls = [s["wall_ms"] for s in d["slowest"]]
    assert walls == sorted(walls, reverse=True) and walls[0] == d["call_max_ms"]
    for s in d["slowest"]:
        assert 0 <= s["c_table_ms"] <= s["wall_ms"] and s["blocks_held"] > 0
        assert (s["c_table_mb"] > 0) == d["native_table"]

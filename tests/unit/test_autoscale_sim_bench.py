"""benchmarks/autoscale_sim.py: ``--autoscaled-only`` runs the autoscaled arm alone, the same run
as in the full comparison, on a small window of a Mooncake-format trace, and its per-request misses by arrival time."""
from __future__ import annotations

import json

from bench_scripts import load_bench_script


def _trace(path):
    # 24 conversations' first turns over 115 s: prompts of 2-6 blocks (512 tokens each), some shared
    rows = [{"timestamp": 5000 * i, "input_length": 1024 + 512 * (i % 5), "output_length": 32 + 8 * (i % 3),
             "hash_ids": [i % 4, 100 + i]} for i in range(24)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _run(bench, tmp_path, *extra: str) -> dict:
    out = tmp_path / "out.json"
    bench.main(["--trace", str(_trace(tmp_path / "t.jsonl")), "--fleet", "4:24:2:1", "--prefill-fractions", "0.5",
                "--steer", "1.0", "--fleet-cap", "--decode-first", "--jobs", "1", "--output", str(out), *extra])
    return json.loads(out.read_text())


def test_autoscaled_only_runs_the_autoscaled_arm_of_the_full_comparison(tmp_path, capsys):
    bench = load_bench_script("autoscale_sim")
    full, alone = _run(bench, tmp_path), _run(bench, tmp_path, "--autoscaled-only")
    assert [(r["split"], r["autoscale"]) for r in full["runs"]] == [("2:2", False), (full["runs"][1]["split"], True)]
    assert [r["autoscale"] for r in alone["runs"]] == [True]
    keep = ("good", "finished", "worker_hours", "start_split", "changes", "decisions", "intervals")
    assert {k: alone["runs"][0][k] for k in keep} == {k: full["runs"][1][k] for k in keep}
    assert alone["runs"][0]["finished"] == 48                       # 24 requests x 2 copies
    fleet = alone["summary"]["fleets"]["4:24:2:1"]
    assert alone["summary"]["autoscaled_only"] and "best_fixed" not in fleet and "goal_met" not in fleet
    assert fleet["autoscaled"]["good"] == alone["runs"][0]["good"]
    assert "best_fixed" in full["summary"]["fleets"]["4:24:2:1"]


def test_misses_by_arrival_account_for_every_finished_request(tmp_path, capsys):
    bench = load_bench_script("autoscale_sim")
    runs = _run(bench, tmp_path, "--slo-ttft-ms", "30", "--slo-itl-ms", "11")   # tight: some miss each
    for r in runs["runs"]:
        bins = r["misses_by_arrival"]
        assert list(bins) == ["0", "50", "100"]
        ttft, itl, both, n = (sum(v[i] for v in bins.values()) for i in range(4))
        assert n == r["finished"] and n - ttft - itl - both == r["good"]
        assert ttft + both > 0 and itl + both > 0

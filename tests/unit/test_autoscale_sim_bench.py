"""benchmarks/autoscale_sim.py: ``--autoscaled-only`` runs the autoscaled arm alone, the same run
as in the full comparison, on a small window of a Mooncake-format trace, and its per-request misses by arrival time."""
from __future__ import annotations

import json

import pytest

from bench_scripts import load_bench_script


def _trace(path, second_half_longer: int = 0):
    # 24 conversations' first turns over 115 s: prompts of 2-6 blocks (512 tokens each), some shared
    # (``second_half_longer``: the last 12 outputs that many tokens longer, so the two windows of 12 differ)
    rows = [{"timestamp": 5000 * i, "input_length": 1024 + 512 * (i % 5),
             "output_length": 32 + 8 * (i % 3) + (second_half_longer if i >= 12 else 0),
             "hash_ids": [i % 4, 100 + i]} for i in range(24)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _run(bench, tmp_path, *extra: str, fleet: str = "4:24:2:1", fractions: str = "0.5",
         out_name: str = "out.json", longer: int = 0) -> dict:
    out = tmp_path / out_name
    bench.main(["--trace", str(_trace(tmp_path / "t.jsonl", longer)), "--fleet", fleet,
                "--prefill-fractions", fractions,
                "--steer", "1.0", "--fleet-cap", "--decode-first", "--jobs", "1", "--output", str(out), *extra])
    return json.loads(out.read_text())


# two windows of 12 requests, two fixed splits, SLOs tight enough that the arms differ
WINDOWS = dict(fleet="4:12:2:1", fractions="0.25,0.5", longer=40)
TIGHT = ("--slo-ttft-ms", "30", "--slo-itl-ms", "11")


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


def test_samples_run_every_arm_on_every_trace_window_and_summarize_them(tmp_path, capsys):
    bench = load_bench_script("autoscale_sim")
    both = _run(bench, tmp_path, *TIGHT, "--samples", "0,1", **WINDOWS)
    arms = sorted((r["sample"], r["split"], r["autoscale"]) for r in both["runs"])
    assert [a[0] for a in arms] == [0, 0, 0, 1, 1, 1] and {a[1] for a in arms if not a[2]} == {"1:3", "2:2"}
    # sample 1 is the trace's second window of 12 requests: the same run as that window on its own
    second = tmp_path / "second.jsonl"
    second.write_text("".join(_trace(tmp_path / "t.jsonl", 40).read_text().splitlines(keepends=True)[12:]))
    alone = _run(bench, tmp_path, *TIGHT, "--trace", str(second), **WINDOWS)
    keep = ("split", "autoscale", "good", "finished", "worker_hours", "itl_p90_ms", "decisions")
    assert ([{k: r.get(k) for k in keep} for r in both["runs"] if r["sample"] == 1]
            == [{k: r.get(k) for k in keep} for r in alone["runs"]])
    first = [{k: r.get(k) for k in keep} for r in both["runs"] if r["sample"] == 0]
    assert first != [{k: r.get(k) for k in keep} for r in alone["runs"]]      # a window, not the first again
    fleet = both["summary"]["fleets"]["4:12:2:1"]
    runs = {(r["sample"], "autoscaled" if r["autoscale"] else r["split"]): r for r in both["runs"]}
    for arm, s in fleet["arms"].items():
        goods = [runs[(k, arm)]["good"] for k in (0, 1)]
        assert s["good_per_sample"] == goods and s["good"]["mean"] == round(sum(goods) / 2, 1)
    means = {a: (s["good"]["mean"], -s["worker_hours"]["mean"]) for a, s in fleet["arms"].items() if a != "autoscaled"}
    best = fleet["best_fixed_by_mean"]
    assert means[best] == max(means.values())
    assert fleet["autoscaled_minus_best"]["per_sample"] == {
        str(k): runs[(k, "autoscaled")]["good"] - runs[(k, best)]["good"] for k in (0, 1)}
    assert len({r["good"] for r in both["runs"]}) > 1                  # the arms differ: the checks can fail
    assert [(f["chosen_on"], f["judged_on"]) for f in fleet["held_out"]["folds"]] == [([0], [1]), ([1], [0])]


def test_merge_of_chunks_is_the_summary_of_one_run(tmp_path, capsys):
    bench = load_bench_script("autoscale_sim")
    whole = _run(bench, tmp_path, *TIGHT, "--samples", "0,1", **WINDOWS)["summary"]
    for k in (0, 1):
        _run(bench, tmp_path, *TIGHT, "--samples", str(k), out_name=f"chunk{k}.json", **WINDOWS)
    bench.main(["--merge", str(tmp_path / "chunk0.json"), str(tmp_path / "chunk1.json"),
                "--output", str(tmp_path / "merged.json")])
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["summary"]["fleets"] == whole["fleets"]
    assert all("intervals" not in r for r in merged["runs"])


def test_start_gives_the_autoscaled_run_its_first_split(tmp_path, capsys):
    bench = load_bench_script("autoscale_sim")
    runs = {start: _run(bench, tmp_path, *TIGHT, "--autoscaled-only", "--start", start, out_name=f"{start}.json",
                        **WINDOWS)["runs"][0] for start in ("1:3", "3:1")}
    for start, r in runs.items():
        assert r["start_split"] == start
        first = r["intervals"][0]
        assert (first["prefill"]["ready"], first["decode"]["ready"]) == tuple(int(x) for x in start.split(":"))
    assert runs["1:3"]["good"] != runs["3:1"]["good"]          # the start matters here: the check can fail
    for bad in ("2:3", "0:4", "x:y"):
        with pytest.raises(ValueError, match="--start"):
            _run(bench, tmp_path, "--autoscaled-only", "--start", bad, **WINDOWS)

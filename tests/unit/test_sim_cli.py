"""`pdserve simulate` end to end on a small synthetic workload: a sweep run with
--jobs 2 (worker processes) gives the same runs, in the same order, as --jobs 1."""
from __future__ import annotations

import json

import pytest

from cluster.cli import main
from cluster.tools.sim.cli import without_wall

ARGS = ["simulate", "--synthetic", "60", "--synthetic-rate", "20", "--prefill-nodes", "1", "--decode-nodes", "2",
        "--tokens-per-id", "16", "--block-size", "16", "--num-blocks", "64",
        "--sweep", "policy=prefix_aware,round_robin", "--sweep", "copies=1,2"]


def _sweep(tmp_path, jobs: int) -> dict:
    out = tmp_path / f"jobs{jobs}.json"
    assert main([*ARGS, "--jobs", str(jobs), "--output", str(out)]) == 0
    return json.loads(out.read_text())


def test_parallel_sweep_matches_serial(tmp_path, capsys):
    serial, parallel = _sweep(tmp_path, 1), _sweep(tmp_path, 2)
    assert [r["params"] for r in parallel["runs"]] == [r["params"] for r in serial["runs"]]
    assert len(serial["runs"]) == 4 and all(r["summary"]["finished"] > 0 for r in serial["runs"])
    assert without_wall(parallel) == without_wall(serial)
    assert parallel["runs"][0]["summary"]["sim"]["wall_s"] > 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 8     # one JSON line per run, twice


def test_jobs_must_be_positive(capsys):
    assert main([*ARGS, "--jobs", "0"]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["policy", "colour=red", "copies=two"])
def test_bad_sweep_is_a_clear_error(spec, capsys):
    assert main([*ARGS[:-4], "--sweep", spec]) == 2
    assert "--sweep" in capsys.readouterr().err


def test_rate_swing_reaches_the_runs_and_a_bad_one_fails_first(tmp_path, capsys):
    base = [*ARGS[:-4], "--jobs", "1"]
    out = tmp_path / "swing.json"
    assert main([*base, "--rate-swing", "0.6", "--output", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["params"]["rate_swing"] == 0.6 and run["summary"]["finished"] == 60
    level = tmp_path / "level.json"
    assert main([*base, "--output", str(level)]) == 0
    assert json.loads(level.read_text())["runs"][0]["summary"] != run["summary"]      # the arrivals moved
    for bad, msg in ((["--rate-swing", "1.0"], "amplitude must be in"), (["--swing-period", "-5"], "period must be > 0")):
        assert main([*base, *bad]) == 2
        assert msg in capsys.readouterr().err

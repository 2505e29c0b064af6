"""The pure parts of benchmarks/sim_validation.py: arrival scaling, the
simulator side on a small trace, and the real-vs-sim comparison."""
import importlib.util
import sys
from pathlib import Path

import pytest

from cluster.tools.sim.cost_model import load_cost_model
from cluster.tools.sim.workload import TraceRequest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def val():
    spec = importlib.util.spec_from_file_location("sim_validation", ROOT / "benchmarks" / "sim_validation.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sim_validation"] = mod          # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("sim_validation", None)


def _reqs(n=12):
    shared = (0, 1, 2)
    return [TraceRequest(f"r{i}", 0.5 * i * (1 + i % 3), 16 * (len(shared) + 2), 4, shared + (100 + 2 * i, 101 + 2 * i))
            for i in range(n)]


def test_offsets_keep_the_pattern_at_the_asked_rate(val):
    reqs = _reqs()
    off = val.offsets_at_rate(reqs, 4.0)
    assert off[0] == 0.0 and (len(off) - 1) / off[-1] == pytest.approx(4.0)
    gaps = [b - a for a, b in zip(off, off[1:])]
    raw = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    assert [g / gaps[0] for g in gaps] == pytest.approx([r / raw[0] for r in raw])


def test_simulated_side_reports_what_the_real_side_reports(val):
    reqs = val.salted(_reqs(), "s", val.offsets_at_rate(_reqs(), 20.0))
    cost = load_cost_model("cpu")
    out = val.simulate(reqs, 1, 1, cost, val.Cfg(num_blocks=256))
    assert out["finished"] == len(reqs) == len(out["decisions"])
    assert 0 < out["hit_rate"] < 1 and out["ttft_mean_s"] > 0 and out["itl_mean_s"] > 0
    assert all(d[0] in ("remote_prefill", "local_prefill") and d[2] == 0 for d in out["decisions"])


def test_compare_reports_relative_errors_hit_points_and_identical_routing(val):
    real = {"ttft_mean_s": 1.0, "ttft_p90_s": 2.0, "itl_mean_s": 0.1, "itl_p90_s": 0.2, "hit_rate": 0.30,
            "decisions": [("remote_prefill", 0, 1), ("local_prefill", None, 0), None]}
    sim = {"ttft_mean_s": 1.05, "ttft_p90_s": 2.5, "itl_mean_s": 0.1, "itl_p90_s": 0.2, "hit_rate": 0.31,
           "decisions": [("remote_prefill", 0, 1), ("remote_prefill", 0, 0), ("local_prefill", None, 0)]}
    c = val.compare(real, sim)
    assert c["sim_vs_real_rel"]["ttft_mean_s"] == pytest.approx(0.05)
    assert c["sim_vs_real_rel"]["ttft_p90_s"] == pytest.approx(0.25)
    assert c["hit_rate_points"] == pytest.approx(1.0)
    assert c["routing_identical"] == 0.5 and c["routing_same_kind"] == 0.5      # the unrecorded one is skipped
    assert c["within_target"] == {"latency_10pct": False, "hit_rate_2pts": True}


def test_sampling_spread_is_zero_for_identical_requests_and_shrinks_with_the_window(val):
    same = {str(i): [float(i), i + 1.0, i + 1.05, i + 1.10] for i in range(50)}
    assert val.sampling_spread(same) == pytest.approx({"ttft_mean_s": 0.0, "ttft_p90_s": 0.0,
                                                       "itl_mean_s": 0.0, "itl_p90_s": 0.0}, abs=1e-9)
    import numpy as np
    rng = np.random.default_rng(1)

    def window(n):
        out = {}
        for i in range(n):
            ttft = rng.lognormal(0.0, 1.0)
            out[str(i)] = [0.0, ttft] + list(ttft + np.cumsum(rng.lognormal(-3.0, 0.5, 5)))
        return out
    small, big = val.sampling_spread(window(25)), val.sampling_spread(window(400))
    for k in ("ttft_mean_s", "ttft_p90_s", "itl_mean_s", "itl_p90_s"):
        assert 0 < big[k] < small[k] / 2           # 16x the requests: about a quarter of the spread
    assert val.sampling_spread({"0": [0.0, 1.0]}) == {}


def test_saved_runs_load_plain_or_gzipped_and_the_shipped_ones_have_traces(val, tmp_path):
    import gzip
    import json
    data = {"setup": "1p1d", "requests": 3, "phases": []}
    (tmp_path / "a.json").write_text(json.dumps(data))
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(json.dumps(data).encode()))
    assert val.load_saved(str(tmp_path / "a.json")) == val.load_saved(str(tmp_path / "a.json.gz")) == data
    shipped = val.load_saved(str(ROOT / "docs" / "sim" / "validation" / "real_1p1d.json.gz"))
    phases = {ph["phase"] if ph["load"] is None else ph["load"] for ph in shipped["phases"]}
    assert phases == {"capacity", 0.5, 0.85, 1.1}
    for ph in shipped["phases"]:
        assert ph["real"]["steps"]["p0"] and ph["real"]["steps"]["d0"] and ph["real"]["frontend_cpu"]


def test_cpu_sampler_records_process_and_host_time(val):
    import time
    s = val.CpuSampler(interval=0.01).start()
    time.sleep(0.05)
    s.stop()
    assert len(s.samples) >= 3
    assert all(b[0] >= a[0] and b[1] >= a[1] and b[2] >= a[2] for a, b in zip(s.samples, s.samples[1:]))


def test_host_report_on_the_shipped_runs(val, capsys):
    import json
    from types import SimpleNamespace
    base = load_cost_model(str(ROOT / "docs" / "sim" / "validation" / "profile.json"))
    val.host_report(SimpleNamespace(host_report=str(ROOT / "docs" / "sim" / "validation" / "real_1p1d.json.gz")), base)
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["load"] for x in lines] == ["capacity", 0.5, 0.85, 1.1]
    for x in lines:
        assert 0 < x["engine_thread_cores"] < x["host_busy_cores"] <= 2.0 + 1e-6
        busy, alone = x["steps"]["decode/decode/others_busy"], x["steps"]["decode/decode/alone"]
        assert busy["wall_over_isolated"] > alone["wall_over_isolated"] >= 1.0


def test_fit_from_refuses_a_run_of_another_setup(val):
    from types import SimpleNamespace
    runs = ROOT / "docs" / "sim" / "validation"
    args = SimpleNamespace(insitu=str(runs / "real_1p1d.json.gz"), fit_from=str(runs / "real_2p2d.json.gz"),
                           trace=str(val.TRACE), calibrate_phases="0.5", host_model="shared", no_frontend=False,
                           jitter=False, save_interference=None)
    with pytest.raises(SystemExit, match="setup 2p2d"):
        val.insitu(args, val.Cfg(), None)

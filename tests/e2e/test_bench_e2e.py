"""`pdserve bench` against a real server: local Ray cluster, gRPC on loopback, tiny Llama."""
from __future__ import annotations

import json

import pytest

from cluster.cli import main
from cluster.config import ServeConfig
from cluster_harness import Cluster, free_port

pytestmark = pytest.mark.ray
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    cfg = ServeConfig(model=str(tiny_llama_dir), num_kv_blocks=256, max_model_len=512, grpc_port=free_port(),
                      metrics_port=0, http_port=0, prefill_workers=1, decode_workers=1,
                      ray_temp_dir=str(tmp_path_factory.mktemp("ray")))
    c = Cluster(cfg)
    yield c
    c.close()


def test_bench_random_writes_results_and_plots(cluster, tmp_path, capsys):
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    rc = main(["bench", "--target", cluster.target, "--num-requests", "20", "--request-rate", "20",
               "--random-input-len", "48", "--random-output-len", "12", "--random-range-ratio", "0.5",
               "--max-concurrency", "8", "--warmup-requests", "2", "--slo-ttft-ms", "60000",
               "--output", str(out), "--plot-dir", str(plots), "--no-progress"])
    assert rc == 0
    assert "requests: 20 finished, 0 failed" in capsys.readouterr().out
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["requests"] == {"sent": 20, "finished": 20, "failed": 0, "incomplete": 0, "not_sent": 0}
    assert s["failures"] == {} and s["warmup"] == {"requests": 2, "failed": 0}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "cap_wait_ms"):
        assert set(s[key]) == {"count", "mean", "p50", "p90", "p95", "p99"}
    assert s["ttft_ms"]["count"] == 20 and s["ttft_ms"]["p50"] > 0
    assert s["output_tokens"] == sum(r["output_tokens"] for r in data["requests"])
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    assert s["total_token_throughput"] > s["output_throughput"]
    assert s["goodput"]["requests"] == 20
    assert all(r["prompt_tokens"] and 6 <= r["output_tokens"] <= 18 for r in data["requests"])
    for name in ("ttft_cdf.png", "itl_cdf.png", "throughput_over_time.png", "latency_over_time.png"):
        assert (plots / name).read_bytes()[:8] == PNG


def test_bench_shared_prefix_sees_cache_hits_within_the_ideal(cluster, tmp_path):
    out = tmp_path / "sp.json"
    rc = main(["bench", "--target", cluster.target, "--dataset", "shared-prefix", "--sp-groups", "2",
               "--sp-prompts-per-group", "5", "--sp-system-len", "96", "--sp-question-len", "8",
               "--sp-output-len", "4", "--sweep", "4,inf", "--seed", "1", "--output", str(out),
               "--plot-dir", str(tmp_path / "plots"), "--no-progress"])
    assert rc == 0
    sweep = json.loads(out.read_text())["sweep"]
    assert [s["request_rate"] for s in sweep] == [4.0, "inf"]
    paced = sweep[0]
    assert paced["requests"]["finished"] == 10 and paced["failures"] == {}
    assert 0 < paced["prefix_cache_hit_rate"] <= paced["ideal_prefix_hit_rate"] + 1e-9
    assert (tmp_path / "plots" / "latency_vs_throughput.png").read_bytes()[:8] == PNG

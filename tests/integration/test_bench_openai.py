"""`pdserve bench --backend openai|openai-chat` against pdserve's own HTTP port: its figures
agree with what the server counted for the same requests (pdserve_* counters and histograms),
and --save-result writes `vllm bench serve`'s result keys."""
from __future__ import annotations

import json

import pytest

from cluster.cli import main
from grpc_harness import http_frontend

# `vllm bench serve --save-result`'s keys for the figures pdserve bench has too
VLLM_KEYS = {"date", "endpoint_type", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "start_times", "errors",
             "max_output_tokens_per_s", "max_concurrent_requests"} | {
    f"{stat}_{metric}_ms" for stat in ("mean", "median", "std", "p99") for metric in ("ttft", "tpot", "itl", "e2el")}
SERIES = ("pdserve_prompt_tokens_total", "pdserve_generation_tokens_total",
          "pdserve_time_to_first_token_seconds_count", "pdserve_time_to_first_token_seconds_sum",
          "pdserve_e2e_request_latency_seconds_count", "pdserve_e2e_request_latency_seconds_sum",
          "pdserve_inter_token_latency_seconds_count")


@pytest.fixture(scope="module")
def fe(tiny_llama_dir):
    with http_frontend(tiny_llama_dir) as f:
        yield f


def counters(fe) -> dict:
    out = {name: fe.sample(name) for name in SERIES}
    out["finished"] = fe.sample("pdserve_requests_total", outcome="finished")
    return out


def bench(fe, tiny_llama_dir, tmp_path, backend: str, *extra: str) -> tuple[dict, dict]:
    before = counters(fe)
    rc = main(["bench", "--backend", backend, "--base-url", fe.http.url, "--tokenizer", str(tiny_llama_dir),
               "--no-progress", "--seed", "3", "--save-result", "--result-dir", str(tmp_path),
               "--result-filename", "vllm.json", "--output", str(tmp_path / "pdserve.json"), *extra])
    assert rc == 0
    after = counters(fe)
    return json.loads((tmp_path / "vllm.json").read_text()), {k: after[k] - before[k] for k in after}


def test_completions_figures_match_the_servers_own(fe, tiny_llama_dir, tmp_path):
    n, out_len = 8, 6
    result, served = bench(fe, tiny_llama_dir, tmp_path, "openai", "--dataset", "random", "--num-requests", str(n),
                           "--random-input-len", "24", "--random-output-len", str(out_len), "--request-rate", "40",
                           "--arrival", "gamma", "--burstiness", "0.5", "--plot-dir", str(tmp_path / "plots"))
    assert VLLM_KEYS <= set(result), sorted(VLLM_KEYS - set(result))
    assert result["endpoint_type"] == "openai" and result["model_id"] == fe.http.state.model_name
    assert result["completed"] == n == served["finished"] and result["failed"] == 0
    # token counts are the server's (usage): exactly what it counted
    assert result["output_lens"] == [out_len] * n and result["total_output_tokens"] == served["pdserve_generation_tokens_total"]
    assert result["input_lens"] == [24] * n and result["total_input_tokens"] == served["pdserve_prompt_tokens_total"]
    # one TTFT and one end-to-end latency per request on both sides; the client's contain the server's
    assert served["pdserve_time_to_first_token_seconds_count"] == n == len(result["ttfts"])
    assert served["pdserve_e2e_request_latency_seconds_count"] == n
    assert sum(result["ttfts"]) >= served["pdserve_time_to_first_token_seconds_sum"] > 0
    e2e_client = result["mean_e2el_ms"] * n / 1000
    assert e2e_client >= served["pdserve_e2e_request_latency_seconds_sum"] > 0
    # a gap per later text chunk: never more than the server's gaps between token deltas
    gaps = sum(len(g) for g in result["itls"])
    assert 0 < gaps <= served["pdserve_inter_token_latency_seconds_count"]
    assert result["mean_tpot_ms"] > 0 and result["p99_ttft_ms"] >= result["median_ttft_ms"]
    assert result["request_throughput"] == pytest.approx(n / result["duration"])
    assert result["output_throughput"] == pytest.approx(n * out_len / result["duration"])
    # the same summary, percentiles and plots as the gRPC path
    own = json.loads((tmp_path / "pdserve.json").read_text())["summary"]
    assert own["backend"] == "openai" and own["requests"]["finished"] == n
    assert own["ttft_ms"]["p50"] == pytest.approx(result["median_ttft_ms"])
    assert own["output_tokens"] == result["total_output_tokens"]
    assert sorted(p.name for p in (tmp_path / "plots").glob("*.png"))


def test_chat_completions_stream_with_usage(fe, tiny_llama_dir, tmp_path):
    n = 4
    result, served = bench(fe, tiny_llama_dir, tmp_path, "openai-chat", "--dataset", "shared-prefix",
                           "--sp-groups", "2", "--sp-prompts-per-group", "2", "--sp-system-len", "32",
                           "--sp-question-len", "8", "--sp-output-len", "5", "--num-requests", str(n))
    assert result["endpoint_type"] == "openai-chat"
    assert result["completed"] == n == served["finished"] and result["failed"] == 0
    assert result["output_lens"] == [5] * n and result["total_output_tokens"] == served["pdserve_generation_tokens_total"]
    assert result["total_input_tokens"] == served["pdserve_prompt_tokens_total"]   # the chat template included


def test_a_wrong_model_or_url_is_a_clear_error(fe, tiny_llama_dir, capsys):
    assert main(["bench", "--backend", "openai", "--base-url", fe.http.url, "--model", "nope",
                 "--tokenizer", str(tiny_llama_dir), "--num-requests", "1"]) != 0
    assert "--model 'nope' is not served" in capsys.readouterr().err
    assert main(["bench", "--backend", "openai", "--num-requests", "1"]) != 0
    assert "needs --base-url" in capsys.readouterr().err

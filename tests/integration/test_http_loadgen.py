"""An outside load generator (guidellm, from PyPI; pdserve did not write it) runs a short,
bounded load against the OpenAI-compatible endpoint and must report no errors.

guidellm streams /v1/chat/completions with `max_completion_tokens`, `ignore_eos`,
`stop: null` and `stream_options.include_usage` + `continuous_usage_stats`, and takes
its token counts from the usage chunk; it probes GET /health and GET /v1/models first.
It tokenizes its synthetic prompts with the tiny model's own tokenizer directory
(offline). Skipped with a reason when guidellm is not installed (`pip install guidellm`).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpc_harness import http_frontend

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("guidellm") is None,
                       reason="guidellm is not installed; `pip install guidellm` to run the outside load generator"),
]
REQUESTS, STREAMS, PROMPT_TOKENS, OUTPUT_TOKENS = 16, 4, 32, 16


def guidellm_exe() -> str:
    beside = Path(sys.executable).with_name("guidellm")
    found = str(beside) if beside.exists() else shutil.which("guidellm")
    if not found:
        pytest.skip("the guidellm package is importable but its `guidellm` command is not on PATH")
    return found


@pytest.fixture(scope="module")
def fe(tiny_llama_dir):
    with http_frontend(tiny_llama_dir) as f:
        yield f


def test_guidellm_bounded_load_without_errors(fe, tiny_llama_dir, tmp_path):
    finished = fe.sample("pdserve_requests_total", outcome="finished")
    generated = fe.sample("pdserve_generation_tokens_total")
    out = tmp_path / "guidellm.json"
    cmd = [guidellm_exe(), "run",
           "--backend", f"kind=openai_http,target={fe.http.url},request_format=/v1/chat/completions",
           "--profile", f"kind=concurrent,streams={STREAMS}",
           "--constraint", f"kind=max_requests,count={REQUESTS}",
           "--constraint", "kind=max_errors,count=1",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={tiny_llama_dir}",
           "--output", f"kind=json,path={out}", "--disable-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"}
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    print(f"guidellm concurrent@{STREAMS}: {totals}; TTFT mean {m['time_to_first_token_ms']['successful']['mean']:.1f}"
          f" ms; ITL mean {m['inter_token_latency_ms']['successful']['mean']:.1f} ms; output "
          f"{m['output_tokens_per_second']['successful']['mean']:.0f} tok/s")
    assert totals == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    out_tokens = m["output_token_count"]["successful"]
    assert out_tokens["count"] == REQUESTS and out_tokens["min"] == out_tokens["max"] == OUTPUT_TOKENS
    assert m["prompt_token_count"]["successful"]["min"] >= PROMPT_TOKENS     # + the chat template's tokens
    # the server agrees: every request guidellm counted finished here, with exactly its tokens
    assert fe.sample("pdserve_requests_total", outcome="finished") == finished + REQUESTS
    assert fe.sample("pdserve_generation_tokens_total") == generated + REQUESTS * OUTPUT_TOKENS

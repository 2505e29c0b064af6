"""Every error status of the OpenAI-compatible endpoint, each produced by a real request
against a real frontend (tiny model): 400 naming the field, 401 without a valid key, 404
unknown model / route, 429 from admission control with Retry-After, 503 while draining."""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.frontends.admission import AdmissionController
from cluster.config import ServeConfig
from cluster.frontends.auth import ApiKeys
from cluster.frontends.http import serve_http
from cluster.frontends.runner import RequestRunner
from grpc_harness import free_port, http_frontend

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fe(tiny_llama_dir):
    with http_frontend(tiny_llama_dir) as f:
        yield f


def call(url: str, path: str, body: dict | bytes | None = None, headers: dict | None = None):
    """(status, headers, parsed JSON body) of one request; errors are answers, not exceptions."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, r.headers, (json.loads(raw) if raw.startswith(b"{") else raw)
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 5000}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "m"}, "messages"),
    ("/v1/completions", {"prompt": [1, 10 ** 6]}, "prompt[1]"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 10 ** 6]]}, "prompt[1][1]"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 99}, "n"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 40}, "stop"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "x", "user": "u" * 300}, "user"),
])
def test_400_names_the_field(fe, path, body, param):
    invalid = fe.sample("pdserve_requests_total", outcome="invalid_argument")
    status, _, out = call(fe.http.url, path, body)
    assert status == 400, out
    err = out["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and param in err["message"]
    assert fe.sample("pdserve_requests_total", outcome="invalid_argument") == invalid + 1


def test_400_for_a_body_that_is_not_json(fe):
    status, _, out = call(fe.http.url, "/v1/completions", b"{not json")
    assert status == 400 and "JSON" in out["error"]["message"]


def test_404_unknown_model_and_route(fe):
    status, _, out = call(fe.http.url, "/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert status == 404 and out["error"]["code"] == "model_not_found" and out["error"]["param"] == "model"
    assert call(fe.http.url, "/v1/models/gpt-9")[0] == 404
    status, _, out = call(fe.http.url, "/v1/nothing-here")
    assert status == 404 and "error" in out


def test_401_without_a_valid_key(fe):
    keys = ApiKeys.parse([("sekret", "acme")])
    srv = fe.loop.run(serve_http(fe.server.runner, ServeConfig(http_port=0), api_keys=keys))
    try:
        body = {"prompt": "x", "max_tokens": 2}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekret"}):
            status, _, out = call(srv.url, "/v1/completions", body, headers)
            assert status == 401 and out["error"]["code"] == "invalid_api_key", headers
        assert call(srv.url, "/v1/models")[0] == 401
        assert call(srv.url, "/health")[0] == 200
        ok = {"authorization": "Bearer sekret"}
        assert call(srv.url, "/v1/models", headers=ok)[0] == 200
        status, _, out = call(srv.url, "/v1/completions", body, ok)
        assert status == 200 and out["usage"]["completion_tokens"] == 2
    finally:
        fe.loop.run(srv.stop(5))


def test_429_when_admission_is_full_with_retry_after(fe):
    runner = RequestRunner(fe.backend, fe.metrics, fe.server.runner.limits, AdmissionController(1, 2000))
    srv = fe.loop.run(serve_http(runner, ServeConfig(http_port=0)))
    try:
        status, _, out = call(srv.url, "/v1/completions", {"prompt": "x", "max_tokens": 1000, "n": 2})
        assert status == 400 and out["error"]["code"] == "request_too_large"   # never fits: retrying can't help
        with ThreadPoolExecutor(1) as pool:
            with fe.stalled_engine():
                first = pool.submit(call, srv.url, "/v1/completions", {"prompt": "x", "max_tokens": 3})
                wait_for(lambda: runner.admission.in_flight == 1, "the first request to be admitted")
                status, headers, out = call(srv.url, "/v1/completions", {"prompt": "y", "max_tokens": 3})
                assert status == 429 and out["error"]["type"] == "rate_limit_error", out
                assert int(headers["Retry-After"]) >= 1 and int(headers["retry-after-ms"]) >= 1
            status, _, out = first.result(120)
            assert status == 200 and out["usage"]["completion_tokens"] == 3
    finally:
        fe.loop.run(srv.stop(5))


def test_503_while_draining_and_in_flight_requests_finish(fe):
    srv = fe.loop.run(serve_http(fe.server.runner, ServeConfig(http_port=0)))
    with ThreadPoolExecutor(1) as pool:
        with fe.stalled_engine():
            first = pool.submit(call, srv.url, "/v1/completions", {"prompt": "x", "max_tokens": 4, "stream": True,
                                                                   "ignore_eos": True})
            wait_for(lambda: srv.state.runner.in_flight == 1, "the first request to be in flight")
            stopped = fe.loop.submit(srv.stop(120))
            wait_for(lambda: not srv.serving, "the drain to start")
            status, _, out = call(srv.url, "/ready")
            assert status == 503 and out == {"status": "draining"}
            assert call(srv.url, "/health")[0] == 200
            status, _, out = call(srv.url, "/v1/chat/completions", {"messages": MSG})
            assert status == 503 and out["error"]["code"] == "unavailable"
            assert not stopped.done()
        status, _, raw = first.result(120)       # the request admitted before the drain finishes
        assert status == 200 and raw.rstrip().endswith(b"data: [DONE]") and b'"finish_reason":"length"' in raw
        stopped.result(120)
    with pytest.raises(urllib.error.URLError):
        call(srv.url, "/health")


def test_serve_stack_runs_http_on_the_grpc_runner_and_drains_it(tiny_llama_dir):
    from cluster.server_stack import start_stack
    from grpc_harness import LoopThread

    with socket.socket() as s:        # a free port: http_port 0 means "off" for the stack
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ServeConfig(model=str(tiny_llama_dir), ray=False, grpc_port=free_port(), metrics_port=0, http_port=port,
                      num_kv_blocks=64, max_model_len=256)
    loop = LoopThread()
    stack = loop.run(start_stack(cfg))
    try:
        assert stack.http.state.runner is stack.grpc.runner is stack.runner   # one router, validator, admission, metrics
        assert f"http://127.0.0.1:{port}" in stack.banner()
        status, _, out = call(stack.http.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2
    finally:
        loop.run(stack.drain_and_stop(10))
        loop.close()
    with pytest.raises(urllib.error.URLError):
        call(stack.http.url, "/health")

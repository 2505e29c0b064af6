"""The OpenAI-compatible HTTP endpoint, driven by the official `openai` client (and raw
HTTP where the client hides the wire: SSE framing, headers), against a real frontend
(tests/grpc_harness.py: LocalEngineBackend, tiny random Llama) whose gRPC endpoint
shares the HTTP endpoint's runner. Error statuses: tests/integration/test_http_errors.py."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai", reason="the openai client is a test extra: pip install -e .[test]")

from cluster.cli.client import GenerationClient  # noqa: E402
from grpc_harness import http_frontend  # noqa: E402
from tiny_models import hf_greedy, load_hf_model  # noqa: E402

PROMPTS = ["The quick brown fox", "The capital of France is", "héllo wörld 🙂", "a"]
LONG = "Paged attention stores keys and values in fixed blocks of tokens. " * 3   # > 2 blocks


@pytest.fixture(scope="module")
def fe(tiny_llama_dir):
    with http_frontend(tiny_llama_dir) as f:
        yield f


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def client(fe):
    return openai.OpenAI(base_url=fe.http.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(fe):
    return fe.http.state.model_name


EXTENSIONS = ("ignore_eos", "top_k", "min_p", "return_tokens_as_token_ids")


def cmpl(client, **kw):
    """client.completions.create with pdserve's extensions moved to extra_body (as the client wants)."""
    kw["extra_body"] = {**kw.pop("extra_body", {}), **{k: kw.pop(k) for k in EXTENSIONS if k in kw}}
    return client.completions.create(**kw)


def chat(client, **kw):
    kw["extra_body"] = {**kw.pop("extra_body", {}), **{k: kw.pop(k) for k in EXTENSIONS if k in kw}}
    return client.chat.completions.create(**kw)


def ids_of(logprobs_tokens) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


def grpc_text(fe, **kw) -> str:
    async def go():
        async with GenerationClient(fe.target) as c:
            return await c.complete(**kw)
    return asyncio.run(go())


def post_sse(fe, path: str, body: dict) -> list[bytes]:
    """Raw SSE lines of a streaming request (the openai client hides `data: [DONE]`)."""
    req = urllib.request.Request(fe.http.url + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.read().split(b"\n") if line]


def test_completions_greedy_match_transformers_and_grpc(fe, hf, client, model):
    tok = fe.backend.tokenizer()
    for p in PROMPTS:
        ids = tok.encode(p)
        want = hf_greedy(hf, ids, 10)
        r = cmpl(client, model=model, prompt=p, max_tokens=10, temperature=0, ignore_eos=True,
                                      logprobs=0, return_tokens_as_token_ids=True)
        ch = r.choices[0]
        assert ids_of(ch.logprobs.tokens) == want, p
        assert ch.text == tok.decode(want) == grpc_text(fe, prompt=p, max_tokens=10, temperature=0.0,
                                                        ignore_eos=True).text
        assert ch.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 10, len(ids) + 10)
        streamed = cmpl(client, model=model, prompt=p, max_tokens=10, temperature=0, ignore_eos=True,
                                             stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == ch.text


def test_token_id_prompts_batch_and_n(fe, hf, client, model):
    tok = fe.backend.tokenizer()
    batch = [tok.encode(p) for p in PROMPTS[:2]]
    r = cmpl(client, model=model, prompt=batch, max_tokens=6, temperature=0, ignore_eos=True, n=2,
                                  logprobs=0, return_tokens_as_token_ids=True)
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    for c in r.choices:   # choice index = prompt index * n + sample index
        assert ids_of(c.logprobs.tokens) == hf_greedy(hf, batch[c.index // 2], 6)
    assert r.usage.prompt_tokens == sum(map(len, batch)) and r.usage.completion_tokens == 4 * 6
    strs = cmpl(client, model=model, prompt=PROMPTS[:3], max_tokens=4, temperature=0, ignore_eos=True,
                                     logprobs=0, return_tokens_as_token_ids=True)
    got = [ids_of(c.logprobs.tokens) for c in sorted(strs.choices, key=lambda c: c.index)]
    assert got == [hf_greedy(hf, tok.encode(p), 4) for p in PROMPTS[:3]]


def test_chat_matches_transformers_streaming_and_not(fe, hf, client, model):
    tok = fe.backend.tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    want = hf_greedy(hf, tok.encode_chat(msgs), 8)
    r = chat(client, model=model, messages=msgs, max_completion_tokens=8, temperature=0,
                                       ignore_eos=True)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == tok.decode(want)
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == len(tok.encode_chat(msgs))
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    chunks = list(chat(client, model=model, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 ignore_eos=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tok.decode(want)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    grpc = grpc_text(fe, messages=msgs, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert grpc.text == r.choices[0].message.content


def test_sse_framing_usage_chunk_and_done(fe, model):
    lines = post_sse(fe, "/v1/completions", {"model": model, "prompt": "The quick", "max_tokens": 5, "stream": True,
                                             "ignore_eos": True, "stream_options": {"include_usage": True}})
    assert lines[-1] == b"data: [DONE]" and all(line.startswith(b"data: ") for line in lines)
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["choices"] == []
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
    cont = post_sse(fe, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4,
        "stream": True, "ignore_eos": True, "stop": None,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    counts = [json.loads(line[6:])["usage"]["completion_tokens"] for line in cont[:-1]]
    assert counts == sorted(counts) and counts[-1] == 4   # guidellm's continuous usage: cumulative


def test_stop_strings(client, model):
    base = cmpl(client, model=model, prompt=LONG, max_tokens=16, temperature=0, ignore_eos=True)
    text = base.choices[0].text
    k = next(i for i in range(3, len(text) - 2) if text.find(text[i:i + 2]) == i)
    stop = text[k:k + 2]
    r = cmpl(client, model=model, prompt=LONG, max_tokens=16, temperature=0, ignore_eos=True,
                                  stop=[stop, "\u2603never"])
    c = r.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (text[:k], "stop", stop)
    s = cmpl(client, model=model, prompt=LONG, max_tokens=16, temperature=0, ignore_eos=True,
                                  stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in s if ch.choices) == text[:k]


def test_seed_reproducible_sampling(client, model):
    def sample(seed):
        r = chat(client, model=model, messages=[{"role": "user", "content": "Tell me"}], n=3,
                                           max_tokens=12, temperature=1.0, top_p=0.95, seed=seed,
                                           ignore_eos=True, top_k=50, min_p=0.01)
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]

    a = sample(7)
    assert sample(7) == a and len(a) == 3
    assert sample(8) != a


def test_logprobs_completions_and_chat(fe, hf, client, model):
    tok = fe.backend.tokenizer()
    want = hf_greedy(hf, tok.encode("The capital"), 5)
    r = cmpl(client, model=model, prompt="The capital", max_tokens=5, temperature=0, ignore_eos=True,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in want]
    assert len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok_s, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[tok_s] == v == max(top.values())   # greedy: the sampled is the best
    c = chat(client, model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2, ignore_eos=True)
    content = c.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob and t.bytes == list(t.token.encode())
    none = chat(client, model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert none.choices[0].logprobs is None


def test_user_is_the_cache_salt_and_cached_tokens_are_reported(client, model):
    def cached(user):
        r = cmpl(client, model=model, prompt=LONG + "salted", max_tokens=1, temperature=0, user=user)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("alice") == 0
    assert cached("alice") >= 16        # a full block of the same tenant's prompt is reused
    assert cached("bob") == 0           # another tenant never sees alice's blocks


def test_models_health_ready_and_shared_metrics(fe, client, model):
    listed = client.models.list()
    assert [m.id for m in listed.data] == [model] and listed.data[0].owned_by == "pdserve"
    assert client.models.retrieve(model).id == model
    for path in ("/health", "/ready"):
        with urllib.request.urlopen(fe.http.url + path, timeout=30) as r:
            assert r.status == 200
    before = fe.sample("pdserve_time_to_first_token_seconds_count")
    finished = fe.sample("pdserve_requests_total", outcome="finished")
    cmpl(client, model=model, prompt="metrics", max_tokens=2)
    with urllib.request.urlopen(fe.http.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    assert fe.sample("pdserve_time_to_first_token_seconds_count") == before + 1   # the runner's metrics
    assert f'pdserve_requests_total{{outcome="finished"}} {finished + 1}' in text   # the same registry


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(fe, model):
    baseline = fe.kv_used()
    cancelled = fe.sample("pdserve_requests_total", outcome="cancelled")
    conn = http.client.HTTPConnection("127.0.0.1", fe.http.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"model": model, "prompt": LONG, "max_tokens": 800,
                                                        "ignore_eos": True, "stream": True}),
                 {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")   # the first token arrived
    with fe.stalled_engine():              # the request cannot finish on its own from here on
        assert fe.backend.engine.stats().kv_blocks_used > baseline   # safe: the engine thread is held
        resp.close()
        conn.close()
        assert fe.loop.run(fe.http.state.runner.wait_idle(60))   # the server saw the disconnect and stopped
    fe.wait_idle(baseline)                 # aborted in the engine, blocks and admission freed
    assert fe.sample("pdserve_requests_total", outcome="cancelled") == cancelled + 1


async def _shrink_server_send_buffer(http_server, client_addr) -> None:
    """The kernel would buffer the whole response on loopback (send buffers autotune to MBs);
    a small fixed send buffer on the server's end of this connection keeps it under test size."""
    for _ in range(500):
        for proto in http_server._server.server_state.connections:
            sock = proto.transport.get_extra_info("socket")
            if sock is not None and sock.getpeername() == client_addr:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no server connection from {client_addr}")


def test_client_that_reads_nothing_is_dropped_after_stream_write_timeout(fe, model):
    """A client that keeps the connection but reads nothing: once the socket's buffers are
    full the server's send waits; after stream_write_timeout the server drops the
    connection, aborts the request and frees its slot and blocks.

    The client pipelines the same request three times on its connection: if the buffers
    ever absorb a whole response (it happened in full CI runs), the next one meets them
    full. Exactly one request is cancelled and not every response completes."""
    baseline = fe.kv_used()
    cancelled = fe.sample("pdserve_requests_total", outcome="cancelled")
    body = json.dumps({"model": model, "prompt": LONG, "max_tokens": 800, "ignore_eos": True,
                       "stream": True, "logprobs": 5}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    state = fe.http.state
    old, state.write_timeout = state.write_timeout, 1.0
    try:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # a small window, set before connect
            sock.connect(("127.0.0.1", fe.http.port))
            fe.loop.run(_shrink_server_send_buffer(fe.http, sock.getsockname()))
            sock.sendall((head + body) * 3)
            end = time.monotonic() + 120
            while fe.sample("pdserve_requests_total", outcome="cancelled") < cancelled + 1:   # reading nothing
                assert time.monotonic() < end, "no response was dropped: the server still waits on the client"
                time.sleep(0.05)
            assert fe.loop.run(state.runner.wait_idle(60)), "the response is still waiting on the client"
            fe.wait_idle(baseline)                        # aborted, blocks and admission freed
            sock.settimeout(60)
            received = b""
            while chunk := sock.recv(1 << 16):            # the server closed the connection
                received += chunk
    finally:
        state.write_timeout = old
    assert received.startswith(b"HTTP/1.1 200") and received.count(b"data: [DONE]") < 3
    assert fe.sample("pdserve_requests_total", outcome="cancelled") == cancelled + 1

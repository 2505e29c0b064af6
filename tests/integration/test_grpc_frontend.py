"""The gRPC frontend end to end: a real grpc.aio server on loopback, a real
engine (LocalEngineBackend, tiny random Llama), clients from cluster.cli.client."""
from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.cli.client import Completion, GenerationClient, build_request
from cluster.pb import generation_pb2 as pb
from cluster.pb import generation_pb2_grpc as pb_grpc
from grpc_harness import start_frontend
from tiny_models import hf_greedy, load_hf_model

PROMPTS = ["The quick brown fox", "The capital of France is", "Once upon a time there was",
           "def hello(): return", "Paged attention stores keys", "héllo wörld 🙂", "code 12345", "a"]


@pytest.fixture(scope="module")
def fe(tiny_llama_dir):
    f = start_frontend(tiny_llama_dir)
    yield f
    f.close()


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf_model(tiny_llama_dir)


def run(coro):
    return asyncio.run(coro)


async def _complete(target, **kw):
    async with GenerationClient(target) as c:
        return await c.complete(**kw)


async def _error(target, request=None, timeout=None, api_key=None, **kw) -> grpc.aio.AioRpcError:
    async with GenerationClient(target, api_key=api_key) as c:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await c.complete(request, timeout=timeout, **kw)
    return ei.value


def test_greedy_streams_match_transformers_for_8_concurrent_requests(fe, hf):
    tok = fe.backend.tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    ttft_before = fe.sample("pdserve_time_to_first_token_seconds_count")

    async def go():
        async with GenerationClient(fe.target) as c:
            return await asyncio.gather(*[
                c.complete(prompt=p, max_tokens=12, temperature=0.0, ignore_eos=True) for p in PROMPTS])

    outs = run(go())
    for p, prompt_ids, out in zip(PROMPTS, ids, outs):
        assert out.tokens == hf_greedy(hf, prompt_ids, 12), p
        assert out.chunks > 1 and out.finish_reason == "length"
        assert out.text == tok.decode(out.tokens)
        assert out.usage[0].prompt_tokens == len(prompt_ids) and out.usage[0].completion_tokens == 12
        assert out.time_to_first_token_s > 0
    assert fe.sample("pdserve_time_to_first_token_seconds_count") == ttft_before + len(PROMPTS)
    assert fe.sample("pdserve_frontend_queue_depth") == 0


def test_token_ids_chat_and_n2(fe, hf):
    tok = fe.backend.tokenizer()
    prompt_ids = tok.encode("The capital of France is")
    out = run(_complete(fe.target, prompt_token_ids=prompt_ids, max_tokens=6, temperature=0.0,
                        ignore_eos=True, n=2))
    want = hf_greedy(hf, prompt_ids, 6)
    assert out.token_ids[0] == want and out.token_ids[1] == want
    msgs = [{"role": "user", "content": "Hello there"}]
    chat = run(_complete(fe.target, messages=msgs, max_tokens=5, temperature=0.0, ignore_eos=True))
    assert chat.tokens == hf_greedy(hf, tok.encode_chat(msgs), 5)


def test_model_info_and_health(fe):
    async def go():
        async with GenerationClient(fe.target) as c:
            return await c.model_info(), await c.health(), await c.health("pdserve.v1.Generation")

    info, overall, svc = run(go())
    assert info.max_model_len == 1024 and info.block_size == 16 and info.max_prompt_tokens == 1023
    assert info.vocab_size == fe.backend.tokenizer().vocab_size and dict(info.pools) == {"colocated": 1}
    assert overall == svc == "SERVING"


def test_reflection_lists_and_calls_the_service(fe):
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(fe.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "pdserve.v1.Generation" in set(db.get_services())
        pool = descriptor_pool.DescriptorPool(db)          # only what reflection told us, like grpcurl
        method = pool.FindServiceByName("pdserve.v1.Generation").methods_by_name["ModelInfo"]
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary("/pdserve.v1.Generation/ModelInfo", request_serializer=req_cls.SerializeToString,
                                   response_deserializer=resp_cls.FromString)
        assert call(req_cls(), timeout=30).block_size == 16


@pytest.mark.parametrize("kw, field", [
    (dict(prompt=""), "prompt"),
    (dict(), "prompt"),
    (dict(prompt="x", top_p=2.0), "sampling.top_p"),
    (dict(prompt="x", temperature=float("nan")), "sampling.temperature"),
    (dict(prompt="x", max_tokens=5000), "sampling.max_tokens"),
    (dict(prompt="x", n=99), "sampling.n"),
    (dict(prompt="x", stop=["s"] * 40), "sampling.stop"),
    (dict(prompt_token_ids=[1, 10 ** 6]), "prompt_token_ids[1]"),
    (dict(prompt_token_ids=[1] * 1024), "prompt_token_ids"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
])
def test_bad_input_is_invalid_argument_and_server_stays_up(fe, kw, field):
    before = fe.sample("pdserve_requests_total", outcome="invalid_argument")
    err = run(_error(fe.target, build_request(**kw)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(field + ":")
    assert fe.sample("pdserve_requests_total", outcome="invalid_argument") == before + 1
    assert run(_complete(fe.target, prompt="ok", max_tokens=2)).finish_reason


def test_invalid_utf8_on_the_wire_is_invalid_argument(fe):
    raw = build_request(prompt="hello XX", max_tokens=2).SerializeToString().replace(b"XX", b"\xff\xfe")
    with grpc.insecure_channel(fe.target) as channel:
        call = channel.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as ei:
            list(call(raw, timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in ei.value.details()


@pytest.fixture
def aborts(fe):
    """Request ids the backend was asked to abort (records, then delegates)."""
    seen: list[str] = []
    real = fe.backend.abort

    async def recording_abort(request_id: str) -> None:
        seen.append(request_id)
        await real(request_id)

    fe.backend.abort = recording_abort
    yield seen
    del fe.backend.abort


def test_client_cancel_mid_stream_aborts_and_frees_blocks(fe, aborts):
    baseline = fe.kv_used()
    cancelled = fe.sample("pdserve_requests_total", outcome="cancelled")

    async def go():
        async with GenerationClient(fe.target) as c:
            n = 0
            async for _ in c.generate(request_id="cancel-me", prompt="Once upon a time", max_tokens=1000,
                                      temperature=0.0, ignore_eos=True):
                n += 1
                if n == 3:
                    break        # leaving the loop cancels the call
            return n

    assert run(go()) == 3
    fe.wait_idle(baseline)
    assert "cancel-me" in aborts
    assert fe.sample("pdserve_requests_total", outcome="cancelled") == cancelled + 1


def test_client_that_reads_nothing_is_cancelled_after_stream_write_timeout(fe, aborts):
    """A client that stays connected but stops reading fills its flow-control window; the
    server's write then waits. After stream_write_timeout the call ends CANCELLED, the
    request is aborted and its slot and blocks come back, while the client still holds it."""
    baseline = fe.kv_used()
    cancelled = fe.sample("pdserve_requests_total", outcome="cancelled")
    req = build_request(request_id="reads-nothing", prompt="Once upon a time", max_tokens=1000,
                        temperature=0.0, ignore_eos=True, logprobs=20)

    async def go():
        # a 1 KB stream window and no BDP probing: the server's writes stall after a few messages
        opts = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
        async with grpc.aio.insecure_channel(fe.target, options=opts) as channel:
            call = pb_grpc.GenerationStub(channel).Generate(req)
            assert await call.read() is not grpc.aio.EOF
            await asyncio.to_thread(fe.wait_idle, baseline)   # freed with the call still open
            with pytest.raises(grpc.aio.AioRpcError) as ei:     # what was buffered, then the status
                while await call.read() is not grpc.aio.EOF:
                    pass
            return ei.value.code(), ei.value.details()

    fe.server.servicer.write_timeout = 1.0
    try:
        code, details = run(go())
    finally:
        fe.server.servicer.write_timeout = 30.0
    assert code == grpc.StatusCode.CANCELLED and "stream_write_timeout" in details
    assert "reads-nothing" in aborts
    assert fe.sample("pdserve_requests_total", outcome="cancelled") == cancelled + 1


def test_client_deadline_exceeded_frees_blocks(fe, aborts):
    baseline = fe.kv_used()
    with fe.stalled_engine():      # nothing can finish: the deadline must fire
        err = run(_error(fe.target, request_id="late", prompt="The quick brown fox", max_tokens=50,
                         timeout=0.5))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    fe.wait_idle(baseline)
    assert "late" in aborts


def test_server_request_timeout_is_deadline_exceeded(fe):
    baseline = fe.kv_used()
    before = fe.sample("pdserve_requests_total", outcome="deadline_exceeded")
    fe.server.runner.request_timeout = 0.5
    try:
        with fe.stalled_engine():
            err = run(_error(fe.target, prompt="The quick brown fox", max_tokens=50))
    finally:
        fe.server.runner.request_timeout = 600.0
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline" in err.details()
    fe.wait_idle(baseline)
    assert fe.sample("pdserve_requests_total", outcome="deadline_exceeded") == before + 1


def test_admission_bound_gives_resource_exhausted_with_retry_hint(fe):
    adm = fe.server.runner.admission
    old = adm.max_requests, adm.max_tokens

    async def go():
        async with GenerationClient(fe.target) as c:
            first = asyncio.create_task(c.complete(prompt="hold the slot", max_tokens=4))
            while adm.in_flight < 1:
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await c.complete(prompt="no room", max_tokens=4)
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            return ei.value

    adm.max_requests = 1
    try:
        with fe.stalled_engine():      # the first request cannot finish and free its slot
            err = run(go())
        adm.max_requests, adm.max_tokens = old[0], 50
        too_big = run(_error(fe.target, prompt="x", max_tokens=100))
    finally:
        adm.max_requests, adm.max_tokens = old
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in err.details()
    assert int(dict(err.trailing_metadata())["retry-after-ms"]) > 0
    assert too_big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued_tokens" in too_big.details()
    assert "retry-after-ms" not in dict(too_big.trailing_metadata() or ())


def test_drain_turns_health_not_serving_and_rejects_new_requests(fe):
    fe.loop.run(fe.server.set_serving(False))
    try:
        async def go():
            async with GenerationClient(fe.target) as c:
                return await c.health()
        assert run(go()) == "NOT_SERVING"
        assert run(_error(fe.target, prompt="x", max_tokens=1)).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        fe.loop.run(fe.server.set_serving(True))
    assert run(_complete(fe.target, prompt="x", max_tokens=1)).finish_reason


def test_stop_keeps_answering_while_in_flight_calls_finish(fe, hf):
    """stop(grace): health NOT_SERVING and new calls UNAVAILABLE from a live server
    while the call in flight finishes with its full output; only then the server stops."""
    srv = fe.serve_another()
    ids = fe.backend.tokenizer().encode("The quick brown fox")
    want = hf_greedy(hf, ids, 12)

    async def go():
        async with GenerationClient(srv.target) as c:
            out = Completion()
            with fe.stalled_engine():                          # the call below cannot finish yet
                it = c.generate(prompt_token_ids=ids, max_tokens=12, temperature=0.0, ignore_eos=True).__aiter__()
                first = asyncio.ensure_future(it.__anext__())   # in flight, waiting for its first token
                for _ in range(600):
                    if srv.runner.in_flight:
                        break
                    await asyncio.sleep(0.01)
                assert srv.runner.in_flight == 1
                stopping = asyncio.wrap_future(fe.loop.submit(srv.stop(grace=60)))
                end = time.monotonic() + 60   # until stop() has begun on the frontend's loop (its thread)
                while (health := await c.health()) == "SERVING" and time.monotonic() < end:
                    await asyncio.sleep(0.01)
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await c.complete(prompt="new", max_tokens=2)
                await asyncio.sleep(0.3)
                assert not stopping.done(), "stop() returned with a call in flight"
            out.add(await first)
            async for r in it:
                out.add(r)
            await asyncio.wait_for(stopping, 60)
            return health, ei.value.code(), out.tokens

    health, code, got = run(go())
    assert health == "NOT_SERVING"
    assert code == grpc.StatusCode.UNAVAILABLE
    assert got == want


def _scrape(url: str) -> dict:
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return {(smp.name, frozenset(smp.labels.items())): smp.value
            for fam in text_string_to_metric_families(text) for smp in fam.samples}


def _get(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_endpoint_serves_series_and_ttft_rises(fe):
    before = _scrape(fe.metrics_server.url)
    names = {name for name, _ in before}
    for name in ("pdserve_time_to_first_token_seconds_count", "pdserve_inter_token_latency_seconds_count",
                 "pdserve_e2e_request_latency_seconds_count", "pdserve_frontend_queue_depth",
                 "pdserve_generation_tokens_total", "pdserve_kv_transfer_seconds_count"):
        assert name in names, name
    for prompt in ("metrics please", "and again"):
        run(_complete(fe.target, prompt=prompt, max_tokens=4, ignore_eos=True))
    after = _scrape(fe.metrics_server.url)

    def rise(name, **labels):
        return _get(after, name, **labels) - _get(before, name, **labels)

    assert rise("pdserve_time_to_first_token_seconds_count") == 2
    assert rise("pdserve_e2e_request_latency_seconds_count") == 2
    assert rise("pdserve_inter_token_latency_seconds_count") >= 2   # >= 1 gap per request (4 tokens)
    assert rise("pdserve_requests_total", outcome="finished") == 2
    assert rise("pdserve_generation_tokens_total") == 8
    assert rise("pdserve_prompt_tokens_total") > 0


def test_cli_generate_streams_from_a_target(fe, hf, capsys):
    from cluster.cli import main

    tok = fe.backend.tokenizer()
    want = tok.decode(hf_greedy(hf, tok.encode("The capital of France is"), 8))
    rc = main(["generate", "The capital of France is", "--target", fe.target, "--max-tokens", "8",
               "--temperature", "0", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0 and out == want + "\n" and "[length: prompt" in err
    rc = main(["generate", "x", "--target", fe.target, "--top-p", "3"])
    out, err = capsys.readouterr()
    assert rc == 1 and "INVALID_ARGUMENT" in err and "sampling.top_p" in err


def test_cli_generate_in_process(tiny_llama_dir, hf, capsys):
    from cluster.cli import main
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.load(tiny_llama_dir)
    want = tok.decode(hf_greedy(hf, tok.encode("Once upon a time"), 6))
    rc = main(["generate", "Once upon a time", "--model", str(tiny_llama_dir), "--max-tokens", "6",
               "--temperature", "0", "--ignore-eos", "--kv-cache-memory", "16MiB", "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0 and out == want + "\n" and err == ""


def test_stop_string_and_logprobs(fe, hf):
    tok = fe.backend.tokenizer()
    ids = tok.encode("The quick brown fox")
    full = run(_complete(fe.target, prompt_token_ids=ids, max_tokens=8, temperature=0.0, ignore_eos=True,
                         logprobs=2))
    assert full.tokens == hf_greedy(hf, ids, 8)
    stop = tok.decode(full.tokens[3:5])
    cut = run(_complete(fe.target, prompt_token_ids=ids, max_tokens=8, temperature=0.0, ignore_eos=True,
                        stop=[stop]))
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert full.text.startswith(cut.text) and len(cut.text) < len(full.text)

    async def lp():
        async with GenerationClient(fe.target) as c:
            return [r async for r in c.generate(prompt_token_ids=ids, max_tokens=3, temperature=0.0, logprobs=2)]

    chunks = run(lp())
    last = chunks[-1]
    assert last.stop_string == "" and last.finish_reason
    per_token = [lp for r in chunks for lp in r.logprobs]
    assert [p.token_id for p in per_token] == [t for r in chunks for t in r.token_ids]
    assert all(len(p.top) == 2 and p.logprob <= 0 for p in per_token)

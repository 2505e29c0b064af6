"""Hostile input: hypothesis drives the real gRPC endpoint (LocalEngineBackend
frontend) with generated requests, valid and not. The server never crashes;
every malformed request gets INVALID_ARGUMENT naming one of the fields that
is wrong (an independent model of the limits decides which those are); every
well-formed one streams to its end; nothing leaks."""
from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.pb import generation_pb2 as pb
from cluster.frontends.validation import ROLES
from grpc_harness import start_frontend

GENERATE = "/pdserve.v1.Generation/Generate"
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)


@pytest.fixture(scope="module")
def fe(tiny_llama_dir):
    f = start_frontend(tiny_llama_dir)
    yield f
    f.close()


@dataclass(frozen=True)
class Spec:
    rid: str
    salt: str
    kind: str                   # none | prompt | ids | messages
    prompt: str
    ids: tuple[int, ...]
    messages: tuple[tuple[str, str], ...]
    add_special: bool | None
    corrupt: str | None         # a string field sent as invalid UTF-8
    sampling: dict


@st.composite
def specs(draw, vocab: int) -> Spec:
    """Half the requests are drawn from valid values only, half from valid and invalid ones."""
    valid = draw(st.booleans())

    def pick(good, bad=()):
        return draw(st.sampled_from(list(good) if valid else list(good) + list(bad)))

    def ids(n):
        return st.lists(st.integers(0, vocab - 1 if valid else vocab + 20), min_size=1 if valid else 0, max_size=n)

    stops = st.text(min_size=1, max_size=5) if valid else st.one_of(
        st.just(""), st.text(min_size=1, max_size=5), st.just("s" * 300))
    sampling = dict(
        max_tokens=pick([1, 2, 3], [0, 5000]), temperature=pick([None, 0.0, 0.8], [-0.5, math.nan, math.inf]),
        top_p=pick([None, 0.5, 1.0], [0.0, 1.5]), top_k=pick([0, 5, 2 ** 32 - 1]),
        min_p=pick([0.0, 0.1, 1.0], [1.5, -0.1]), seed=pick([None, 0, 2 ** 63 - 1], [2 ** 64 - 1]), n=pick([None, 1, 2], [0, 17]),
        stop=draw(st.lists(stops, max_size=3 if valid else 18)),
        stop_token_ids=draw(st.lists(st.integers(0, vocab - 1 if valid else vocab + 20), max_size=5 if valid else 70)),
        ignore_eos=pick([False, True]), logprobs=pick([None, 0, 5, 20], [21]),
        repetition_penalty=pick([None, 1.0, 1.3], [0.0, -1.0]),
        frequency_penalty=pick([0.0, 1.5], [-2.5, 2.5]), presence_penalty=pick([0.0, -1.0], [2.5]),
        include_stop_str_in_output=pick([False, True]))
    roles = st.sampled_from(ROLES if valid else ROLES + ("wizard", ""))
    many = [] if valid else [st.just([("user", "x")] * 300)]
    msgs = draw(st.one_of(st.lists(st.tuples(roles, TEXT), min_size=1 if valid else 0, max_size=4), *many))
    return Spec(rid=pick(["", "ok"], ["with space", "x" * 300]),
                salt=draw(st.one_of(st.just(""), TEXT, *([] if valid else [st.just("s" * 300)]))),
                kind=pick(["prompt", "ids", "messages"], ["none"]),
                prompt=draw(TEXT.filter(bool) if valid else TEXT),
                ids=tuple(draw(st.one_of(ids(40), *([] if valid else [st.just([7] * 1100)])))),
                messages=tuple(msgs), add_special=pick([None, False, True]),
                corrupt=pick([None], [None] * 4 + ["prompt", "cache_salt", "request_id"]), sampling=sampling)


def build(spec: Spec, serial: int) -> pb.GenerateRequest:
    s = {k: v for k, v in spec.sampling.items() if v is not None}
    req = pb.GenerateRequest(request_id={"ok": f"fuzz-{serial}"}.get(spec.rid, spec.rid), cache_salt=spec.salt,
                             sampling=pb.SamplingParams(**s))
    if spec.add_special is not None:
        req.add_special_tokens = spec.add_special
    if spec.kind == "prompt":
        req.prompt = spec.prompt
    elif spec.kind == "ids":
        req.prompt_token_ids.SetInParent()
        req.prompt_token_ids.ids.extend(spec.ids)
    elif spec.kind == "messages":
        req.messages.SetInParent()
        for role, content in spec.messages:
            req.messages.messages.add(role=role, content=content)
    return req


def wire(spec: Spec, req: pb.GenerateRequest) -> bytes:
    data = req.SerializeToString()
    if spec.corrupt:   # appended last: it wins (a oneof member too)
        num = pb.GenerateRequest.DESCRIPTOR.fields_by_name[spec.corrupt].number
        data += bytes([num << 3 | 2, 3]) + b"a\xff\xfe"
    return data


def bad_fields(spec: Spec, vocab: int) -> set[str]:
    """The fields an independent reading of the limits finds wrong (empty: valid)."""
    if spec.corrupt:
        return {spec.corrupt}
    bad, s = set(), spec.sampling
    if spec.rid in ("with space", "x" * 300):
        bad.add("request_id")
    if len(spec.salt) > 256:
        bad.add("cache_salt")
    if spec.kind == "none" or (spec.kind == "prompt" and not spec.prompt):
        bad.add("prompt")
    if spec.kind == "ids":
        if not spec.ids or len(spec.ids) > 1023:
            bad.add("prompt_token_ids")
        bad |= {f"prompt_token_ids[{i}]" for i, t in enumerate(spec.ids) if t >= vocab}
    if spec.kind == "messages":
        if not spec.messages or len(spec.messages) > 256:
            bad.add("messages")
        bad |= {f"messages[{i}].role" for i, (r, _) in enumerate(spec.messages) if r not in ROLES}
    checks = {"max_tokens": not 1 <= s["max_tokens"] <= 3,
              "temperature": s["temperature"] is not None and not 0 <= s["temperature"] < math.inf,
              "top_p": s["top_p"] is not None and not 0 < s["top_p"] <= 1, "min_p": not 0 <= s["min_p"] <= 1,
              "n": s["n"] is not None and not 1 <= s["n"] <= 16,
              "seed": s["seed"] is not None and s["seed"] >= 2 ** 63,
              "logprobs": s["logprobs"] is not None and s["logprobs"] > 20,
              "repetition_penalty": s["repetition_penalty"] is not None and s["repetition_penalty"] <= 0,
              "frequency_penalty": abs(s["frequency_penalty"]) > 2, "presence_penalty": abs(s["presence_penalty"]) > 2,
              "stop": len(s["stop"]) > 16, "stop_token_ids": len(s["stop_token_ids"]) > 64}
    bad |= {f"sampling.{k}" for k, v in checks.items() if v}
    bad |= {f"sampling.stop[{i}]" for i, x in enumerate(s["stop"]) if not 1 <= len(x) <= 256}
    bad |= {f"sampling.stop_token_ids[{i}]" for i, t in enumerate(s["stop_token_ids"]) if t >= vocab}
    return bad


def run_fuzz(fe, examples: int) -> dict:
    vocab = fe.backend.tokenizer().vocab_size
    baseline = fe.kv_used()
    invalid0 = fe.sample("pdserve_requests_total", outcome="invalid_argument")
    seen = {"valid": 0, "invalid": 0, "serial": 0}
    channel = grpc.insecure_channel(fe.target)
    call = channel.unary_stream(GENERATE, request_serializer=lambda b: b,
                                response_deserializer=pb.GenerateResponse.FromString)

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(spec=specs(vocab))
    def one(spec: Spec) -> None:
        seen["serial"] += 1
        req = build(spec, seen["serial"])
        expected = bad_fields(spec, vocab)
        try:
            chunks = list(call(wire(spec, req), timeout=120))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), spec)
            named = e.details().split(":", 1)[0]
            assert named in expected, (named, e.details(), expected, spec)
            seen["invalid"] += 1
            return
        assert not expected, f"accepted a request with bad {expected}: {spec}"
        n = req.sampling.n if req.sampling.HasField("n") else 1
        assert {c.index for c in chunks if c.finish_reason} == set(range(n)), spec
        seen["valid"] += 1

    try:
        one()
    finally:
        channel.close()
    fe.wait_idle(baseline)
    assert fe.sample("pdserve_requests_total", outcome="invalid_argument") - invalid0 == seen["invalid"]
    return seen


def test_fuzz_grpc_fast(fe):
    seen = run_fuzz(fe, 300)
    assert seen["valid"] >= 10 and seen["invalid"] >= 10, seen


@pytest.mark.chaos_full
@pytest.mark.timeout(7200)
def test_fuzz_grpc_full(fe):
    seen = run_fuzz(fe, 10_000)
    assert seen["valid"] + seen["invalid"] >= 10_000, seen

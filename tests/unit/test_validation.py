"""cluster/frontends/validation.py: every bad field -> ValidationError naming it; good input -> a GenerateJob."""
from __future__ import annotations

import math

import pytest

from cluster.frontends.admission import AdmissionController
from cluster.orchestration.backend import BackendError
from cluster.frontends.validation import (ChatMessage, GenerateInput, Limits, SamplingInput, ValidationError,
                                validate_request)
from engine.block_hash import block_hashes


class CharTokenizer:
    """One token per character (code point mod 100); BOS = 100 when special tokens are on."""
    vocab_size = 128
    eos_token_ids = (101,)

    def encode(self, text, add_special_tokens=True):
        return ([100] if add_special_tokens else []) + [ord(c) % 100 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True):
        if any(m["content"] == "boom" for m in messages):
            raise ValueError("template says no")
        out = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return out + ("<assistant>" if add_generation_prompt else "")


LIMITS = Limits(max_model_len=64, block_size=4, vocab_size=128, max_messages=4)
TOK = CharTokenizer()


def check(inp: GenerateInput, **kw):
    return validate_request(inp, TOK, LIMITS, **kw)


def field_of(inp: GenerateInput, **kw) -> str:
    with pytest.raises(ValidationError) as ei:
        check(inp, **kw)
    assert ei.value.message and ei.value.field in str(ei.value)
    return ei.value.field


def test_good_prompt_builds_job_with_hashes_and_salt():
    job = check(GenerateInput(request_id="r1", prompt="abcdefghij",
                              sampling=SamplingInput(max_tokens=5, temperature=0.0, seed=3, stop=["x"])),
                cache_salt="tenant-a", deadline=123.0)
    assert job.request_id == "r1" and job.prompt_token_ids[0] == 100 and len(job.prompt_token_ids) == 11
    assert job.sampling.max_tokens == 5 and job.sampling.greedy and job.sampling.seed == 3
    assert job.sampling.stop == ("x",) and job.deadline == 123.0 and job.cache_salt == "tenant-a"
    assert job.block_hashes == tuple(block_hashes(list(job.prompt_token_ids), 4, "tenant-a"))
    assert len(job.block_hashes) == 2
    other = check(GenerateInput(prompt="abcdefghij"), cache_salt="tenant-b")
    assert other.block_hashes[0] != job.block_hashes[0]


def test_defaults_fill_the_context_and_generate_an_id():
    job = check(GenerateInput(prompt="abc", add_special_tokens=False))
    assert job.request_id.startswith("req-") and job.prompt_token_ids == (97, 98, 99)
    assert job.sampling.max_tokens == 64 - 3 and job.sampling.n == 1 and job.cache_salt is None


def test_token_ids_and_messages():
    assert check(GenerateInput(prompt_token_ids=[1, 2, 127])).prompt_token_ids == (1, 2, 127)
    job = check(GenerateInput(messages=[ChatMessage("system", "s"), ChatMessage("user", "hi")]))
    expected = TOK.encode("<system>s<user>hi<assistant>", add_special_tokens=False)
    assert list(job.prompt_token_ids) == expected


def test_bytes_prompt_is_decoded_as_utf8():
    job = check(GenerateInput(prompt="é".encode(), add_special_tokens=False))
    assert job.prompt_token_ids == (ord("é") % 100,)


@pytest.mark.parametrize("inp, field", [
    (GenerateInput(), "prompt"),
    (GenerateInput(prompt=""), "prompt"),
    (GenerateInput(prompt="a", prompt_token_ids=[1]), "prompt_token_ids"),
    (GenerateInput(prompt=b"\xff\xfe"), "prompt"),
    (GenerateInput(prompt="a\ud800b"), "prompt"),
    (GenerateInput(prompt="x" * 64), "prompt"),                      # 65 tokens > max_model_len - 1
    (GenerateInput(prompt="x" * 10_000), "prompt"),                  # character limit
    (GenerateInput(prompt_token_ids=[]), "prompt_token_ids"),
    (GenerateInput(prompt_token_ids=[1, 128]), "prompt_token_ids[1]"),
    (GenerateInput(prompt_token_ids=[-1]), "prompt_token_ids[0]"),
    (GenerateInput(prompt_token_ids=list(range(64))), "prompt_token_ids"),
    (GenerateInput(messages=[]), "messages"),
    (GenerateInput(messages=[ChatMessage("user", "a")] * 5), "messages"),
    (GenerateInput(messages=[ChatMessage("user", "a"), ChatMessage("wizard", "b")]), "messages[1].role"),
    (GenerateInput(messages=[ChatMessage("user", b"\xc3")]), "messages[0].content"),
    (GenerateInput(messages=[ChatMessage("user", "boom")]), "messages"),
    (GenerateInput(request_id="has space", prompt="a"), "request_id"),
    (GenerateInput(request_id="x" * 300, prompt="a"), "request_id"),
])
def test_bad_input_names_the_field(inp, field):
    assert field_of(inp) == field


@pytest.mark.parametrize("sampling, field", [
    (dict(max_tokens=0), "sampling.max_tokens"),
    (dict(max_tokens=60), "sampling.max_tokens"),           # prompt 5 + 60 > 64
    (dict(temperature=-0.1), "sampling.temperature"),
    (dict(temperature=math.nan), "sampling.temperature"),
    (dict(temperature=math.inf), "sampling.temperature"),
    (dict(top_p=0.0), "sampling.top_p"),
    (dict(top_p=1.5), "sampling.top_p"),
    (dict(top_k=-1), "sampling.top_k"),
    (dict(min_p=2.0), "sampling.min_p"),
    (dict(n=0), "sampling.n"),
    (dict(n=17), "sampling.n"),
    (dict(logprobs=21), "sampling.logprobs"),
    (dict(seed=2 ** 64), "sampling.seed"),
    (dict(seed="7"), "sampling.seed"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty"),
    (dict(frequency_penalty=2.5), "sampling.frequency_penalty"),
    (dict(presence_penalty=-3.0), "sampling.presence_penalty"),
    (dict(stop=["a"] * 17), "sampling.stop"),
    (dict(stop=["ok", ""]), "sampling.stop[1]"),
    (dict(stop=["ok", "y" * 257]), "sampling.stop[1]"),
    (dict(stop=[b"\xff"]), "sampling.stop[0]"),
    (dict(stop_token_ids=[5, 999]), "sampling.stop_token_ids[1]"),
])
def test_bad_sampling_names_the_field(sampling, field):
    assert field_of(GenerateInput(prompt="abcd", sampling=SamplingInput(**sampling))) == field


def test_bad_cache_salt():
    assert field_of(GenerateInput(prompt="a"), cache_salt="s" * 300) == "cache_salt"


def test_limits_from_model_and_prompt_bound():
    from cluster.orchestration.backend import ModelInfoData
    lim = Limits.from_model(ModelInfoData("m", 8, 4, 128, {}))
    assert lim.max_prompt_tokens == 7
    ok = validate_request(GenerateInput(prompt_token_ids=[1] * 7), TOK, lim)
    assert ok.sampling.max_tokens == 1
    with pytest.raises(ValidationError):
        validate_request(GenerateInput(prompt_token_ids=[1] * 8), TOK, lim)


def test_real_tokenizer_chat_template(tiny_llama_dir):
    from engine.tokenizer import Tokenizer
    tok = Tokenizer.load(tiny_llama_dir)
    lim = Limits(max_model_len=256, block_size=16, vocab_size=tok.vocab_size)
    msgs = [ChatMessage("user", "The capital of France")]
    job = validate_request(GenerateInput(messages=msgs), tok, lim)
    assert list(job.prompt_token_ids) == tok.encode_chat([{"role": "user", "content": "The capital of France"}])


def test_admission_bounds_requests_tokens_and_duplicates():
    adm = AdmissionController(max_requests=2, max_tokens=100)
    j1 = check(GenerateInput(request_id="a", prompt="abc", sampling=SamplingInput(max_tokens=10)))
    j2 = check(GenerateInput(request_id="b", prompt="abc", sampling=SamplingInput(max_tokens=10)))
    j3 = check(GenerateInput(request_id="c", prompt="abc", sampling=SamplingInput(max_tokens=10)))
    t1 = adm.admit(j1)
    with pytest.raises(BackendError) as dup:
        adm.admit(j1)
    assert dup.value.code == "ALREADY_EXISTS"
    adm.admit(j2)
    with pytest.raises(BackendError) as full:
        adm.admit(j3)
    assert full.value.code == "RESOURCE_EXHAUSTED" and full.value.retry_after_s > 0
    adm.release(t1)
    adm.release(t1)                        # idempotent
    assert adm.in_flight == 1 and adm.admit(j3)
    big = check(GenerateInput(request_id="d", prompt="abc", sampling=SamplingInput(max_tokens=50, n=2)))
    with pytest.raises(BackendError) as too_big:
        adm.admit(big)
    assert too_big.value.code == "RESOURCE_EXHAUSTED" and too_big.value.retry_after_s is None

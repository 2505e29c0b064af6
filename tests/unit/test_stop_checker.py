"""StopChecker: eos, stop ids, stop strings (cut, held back, spanning tokens), lengths."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.stop_checker import StopChecker
from engine.tokenizer import Tokenizer

EOS = 2


def checker(prompt: int = 3, max_total: int | None = None, **kw) -> StopChecker:
    kw.setdefault("max_tokens", 100)
    return StopChecker(SamplingParams(**kw), [EOS], num_prompt_tokens=prompt, max_total_tokens=max_total)


def feed(c: StopChecker, pieces: list[str], token: int = 50):
    """Feed text pieces as successive tokens; return the emitted chunks and the last result."""
    emitted, res = [], None
    for piece in pieces:
        res = c.step(token, piece)
        emitted.append(res.text)
        if res.finished:
            break
    return emitted, res


# ---------------------------------------------------------------- token level
def test_eos_stops_unless_ignored():
    _, res = feed(checker(), ["a", "b"], token=EOS)
    assert (res.finished, res.finish_reason, res.stop_reason, res.text) == (True, "stop", None, "a")
    emitted, res = feed(checker(ignore_eos=True, max_tokens=3), ["a", "b", "c"], token=EOS)
    assert res.finish_reason == "length" and "".join(emitted) == "abc"


def test_stop_token_id_reports_the_id_even_with_ignore_eos():
    c = checker(stop_token_ids=(7, EOS), ignore_eos=True)
    assert not c.step(5, "x").finished
    res = c.step(EOS, "")
    assert (res.finish_reason, res.stop_reason) == ("stop", EOS)


def test_max_tokens_and_max_total_tokens():
    c = checker(max_tokens=2)
    assert not c.step(5, "a").finished
    assert c.step(5, "b").finish_reason == "length"
    c = checker(prompt=8, max_total=10)
    assert not c.step(5, "a").finished
    res = c.step(5, "b")
    assert (res.finished, res.finish_reason) == (True, "length")
    assert c.text == "ab" and c.num_output_tokens == 2


def test_bad_inputs():
    with pytest.raises(ValueError, match="prompt has 10 tokens.*at most 10.*shorten"):
        checker(prompt=10, max_total=10)
    c = checker(max_tokens=1)
    c.step(5, "a")
    with pytest.raises(ValueError, match="already finished"):
        c.step(5, "b")


# ---------------------------------------------------------------- stop strings
def test_stop_string_cut_from_output():
    emitted, res = feed(checker(stop=("STOP",)), ["The answer", " is 42. STOP and more"])
    assert (res.finish_reason, res.stop_reason) == ("stop", "STOP")
    assert "".join(emitted) == "The answer is 42. "


def test_stop_string_kept_when_asked():
    emitted, _ = feed(checker(stop=("STOP",), include_stop_str_in_output=True), ["a STOP b"])
    assert "".join(emitted) == "a STOP"


def test_stop_string_spanning_tokens_is_never_partially_streamed():
    emitted, res = feed(checker(stop=("</answer>",)), ["42", " <", "/ans", "wer", ">", "tail"])
    assert emitted == ["42", " ", "", "", ""]   # "<", "</ans", ... held back, then cut
    assert res.stop_reason == "</answer>" and "".join(emitted) == "42 "


def test_held_back_text_released_when_it_is_not_a_stop():
    emitted, res = feed(checker(stop=("abc",)), ["xa", "b", "d", "ab"])
    assert emitted == ["x", "", "abd", ""]
    assert not res.finished
    c = checker(stop=("abc",), max_tokens=2)   # finishing for another reason releases the held text
    emitted, res = feed(c, ["xa", "b"])
    assert res.finish_reason == "length" and "".join(emitted) == "xab" == c.text


def test_holdback_is_longest_stop_prefix_not_just_the_first_candidate():
    emitted, _ = feed(checker(stop=("ababc",)), ["zbab", "ab", "c"])
    assert emitted == ["zb", "", ""]   # "abab" is not a suffix of "zbab" but "ab" is; then "abab" waits


def test_first_completed_stop_wins():
    emitted, res = feed(checker(stop=("abcd", "bc")), ["abcd"])
    assert res.stop_reason == "bc" and "".join(emitted) == "a"
    emitted, res = feed(checker(stop=("cd", "xabcd")), ["xabcd"])
    assert res.stop_reason == "xabcd" and "".join(emitted) == ""   # same end: earliest start


def test_stop_string_beats_eos_on_the_same_token():
    c = checker(stop=("!",))
    res = c.step(EOS, "hi! there")
    assert (res.finish_reason, res.stop_reason, res.text) == ("stop", "!", "hi")


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc!", max_size=30), stops=st.lists(st.text(alphabet="abc!", min_size=1, max_size=6),
       min_size=1, max_size=3), cuts=st.lists(st.integers(0, 30), max_size=10), include=st.booleans())
def test_property_streamed_text_is_prefix_of_final_and_final_is_reference(text, stops, cuts, include):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    c = checker(stop=tuple(stops), include_stop_str_in_output=include)
    emitted, res = feed(c, pieces)
    final = "".join(emitted)
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if hits:  # reference: the stop completed first (earliest end, then earliest start)
        end, start, stop = min(hits)
        assert res.finished and res.stop_reason == stop
        assert final == (text[:end] if include else text[:start])
    else:     # nothing cut; only a possible stop-string start is still held back
        assert not res.finished and text.startswith(final)
        held = text[len(final):]
        assert held == "" or any(s.startswith(held) and len(held) < len(s) for s in stops)


# ---------------------------------------------------------------- with real tokens
def test_process_with_detokenizer_cuts_multi_token_stop(tiny_llama_dir):
    tok = Tokenizer.from_hf_dir(tiny_llama_dir)
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    c = StopChecker(SamplingParams(stop=("lazy dog",), max_tokens=100), tok.eos_token_ids, num_prompt_tokens=1)
    d = IncrementalDetokenizer(tok, [1])
    streamed = ""
    for i in ids:
        res = c.process(i, d)
        streamed += res.text
        assert "The quick brown fox jumps over the ".startswith(streamed)
        if res.finished:
            break
    assert streamed == "The quick brown fox jumps over the " and res.stop_reason == "lazy dog"
    assert len(tok.encode("lazy dog")) > 1   # the stop string really spans tokens


def test_process_flushes_incomplete_tail_on_length(tiny_llama_dir):
    tok = Tokenizer.from_hf_dir(tiny_llama_dir)
    ids = tok.encode("ok 🚀")
    partial = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    c = StopChecker(SamplingParams(max_tokens=partial), tok.eos_token_ids, num_prompt_tokens=1)
    d = IncrementalDetokenizer(tok, [])
    out = "".join(c.process(i, d).text for i in ids[:partial])
    assert c.finished and out == tok.decode(ids[:partial])

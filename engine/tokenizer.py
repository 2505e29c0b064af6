"""Text <-> token ids, built on the Rust ``tokenizers`` library only.

Two sources: a Hugging Face model directory (tokenizer.json plus
tokenizer_config.json / generation_config.json / config.json) or a GGUF file,
whose metadata holds a byte-level BPE vocabulary and merges that we rebuild
into a ``tokenizers.Tokenizer`` without transformers.
"""
from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from engine.chat_template import ChatTemplate

# GGUF token types (llama.cpp's llama_token_type)
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

# Pre-tokenizer regexes by GGUF ``tokenizer.ggml.pre`` (the same split rules
# the original tokenizer.json files use).
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_STYLE = {"gpt2", "default", "gpt-2", "olmo", "jais", "phi-2", "mpt", "gpt-neox"}
_DIGIT_SPLIT_STYLE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_STYLE = {"llama-bpe", "llama3", "smaug-bpe", "falcon3", "dbrx"}
_QWEN2_STYLE = {"qwen2", "deepseek-r1-qwen"}
# llama.cpp also ends generation on these end-of-turn control tokens
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class Tokenizer:
    """A loaded tokenizer plus what the engine needs around it: eos ids,
    special tokens and the chat template."""

    def __init__(self, backend: _Backend, *, eos_token_ids: Iterable[int] = (),
                 bos_token_id: int | None = None, chat_template: str | None = None,
                 add_bos_token: bool = False) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template_source = chat_template
        self._chat_template = ChatTemplate(chat_template) if chat_template else None
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.validate_token_ids(self.eos_token_ids)

    # ----------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """A GGUF file or a Hugging Face directory, chosen by what ``path`` is."""
        p = Path(path)
        if p.is_file() and p.suffix == ".gguf":
            return cls.from_gguf(p)
        if p.is_dir():
            return cls.from_hf_dir(p)
        raise ValueError(f"no tokenizer at {str(path)!r}: give a Hugging Face model directory "
                         "(with tokenizer.json) or a .gguf file")

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        d = Path(path)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{d} has no tokenizer.json; only 'fast' tokenizers are supported "
                             "(save one with transformers' tokenizer.save_pretrained)")
        backend = _Backend.from_file(str(tok_file))
        cfg = _read_json(d / "tokenizer_config.json")
        model_cfg = _read_json(d / "config.json")
        gen_cfg = _read_json(d / "generation_config.json")

        def tid(tok: Any) -> int | None:
            content = tok.get("content") if isinstance(tok, Mapping) else tok
            return backend.token_to_id(content) if isinstance(content, str) else None

        eos_ids = [tid(cfg.get("eos_token"))]
        for src in (gen_cfg, model_cfg):
            eos_ids += _as_id_list(src.get("eos_token_id"))
        bos_id = tid(cfg.get("bos_token"))
        if bos_id is None:
            bos_id = next(iter(_as_id_list(gen_cfg.get("bos_token_id") or model_cfg.get("bos_token_id"))), None)
        template = _hf_chat_template(d, cfg)
        # tokenizer.json's post-processor already adds BOS where the model wants it
        return cls(backend, eos_token_ids=[i for i in eos_ids if i is not None], bos_token_id=bos_id,
                   chat_template=template, add_bos_token=False)

    @classmethod
    def from_gguf(cls, path_or_reader: Any) -> Tokenizer:
        """Rebuild a byte-level BPE tokenizer from GGUF metadata. Accepts a path
        or an already open :class:`engine.loader.gguf_file.GGUFFile`."""
        from engine.loader.gguf_file import GGUFFile

        meta = path_or_reader if isinstance(path_or_reader, GGUFFile) else GGUFFile(path_or_reader)
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported: only byte-level BPE "
                             "('gpt2') is; load the model from a Hugging Face directory instead")
        tokens: list[str] = meta.get("tokenizer.ggml.tokens")
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        pre = meta.get("tokenizer.ggml.pre") or "default"
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = _Backend(models.BPE(vocab, merges, ignore_merges=pre in _LLAMA3_STYLE))
        backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types) if ty == _GGUF_CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _GGUF_USER_DEFINED])
        eos_ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"),
                   meta.get("tokenizer.ggml.eom_token_id")]
        eos_ids += [vocab[t] for t in _END_OF_TURN_TOKENS
                    if t in vocab and types[vocab[t]] == _GGUF_CONTROL]
        return cls(backend, eos_token_ids=[i for i in eos_ids if i is not None],
                   bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                   chat_template=meta.get("tokenizer.chat_template"),
                   add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token")))

    # ----------------------------------------------------------- text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}; pass token ids directly instead")
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Hot path (the detokenizer calls it per token): ids are not validated."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The ``tokenizers`` definition (tokenizer.json) of this tokenizer (engine/tokenizer_export.py)."""
        return self._backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def validate_token_ids(self, ids: Iterable[int], vocab_size: int | None = None) -> list[int]:
        """Return ``ids`` as a list of ints, or raise ValueError naming the bad id. ``vocab_size``:
        the range to check against when it is not the tokenizer's own (the model's embedding
        rows, which can outnumber the tokenizer's tokens)."""
        limit = self.vocab_size if vocab_size is None else vocab_size
        out: list[int] = []
        for pos, t in enumerate(ids):
            if isinstance(t, bool):
                raise ValueError(f"token id at position {pos} is a bool ({t}); give integer token ids")
            try:
                v = operator.index(t)
            except TypeError:
                raise ValueError(f"token id at position {pos} is {t!r} ({type(t).__name__}); "
                                 "give integer token ids") from None
            if not 0 <= v < limit:
                raise ValueError(f"token id {v} at position {pos} is out of range: the vocabulary has "
                                 f"{limit} tokens (valid ids are 0..{limit - 1})")
            out.append(v)
        return out

    # ----------------------------------------------------------- chat
    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        """Render ``messages`` to the prompt string (like transformers with tokenize=False)."""
        template = ChatTemplate(chat_template) if chat_template else self._chat_template
        if template is None:
            raise ValueError("this model has no chat template: send a plain text prompt, or pass "
                             "chat_template=... explicitly")
        return template.render(messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self._token_str(self.bos_token_id),
                               eos_token=self._token_str(self.eos_token_id), **kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Render then encode; the template already places BOS where it wants it."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)

    def _token_str(self, token_id: int | None) -> str:
        return (self._backend.id_to_token(token_id) or "") if token_id is not None else ""

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids}, "
                f"bos_token_id={self.bos_token_id}, chat_template={self.has_chat_template})")


# --------------------------------------------------------------- helpers
def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or remove the file") from e
    return data if isinstance(data, dict) else {}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _hf_chat_template(d: Path, cfg: dict) -> str | None:
    jinja_file = d / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = cfg.get("chat_template") or _read_json(d / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: prefer "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_STYLE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3_STYLE or pre in _QWEN2_STYLE:
        regex = _LLAMA3_REGEX if pre in _LLAMA3_STYLE else _QWEN2_REGEX
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in _GPT2_STYLE:
        return byte_level
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not known; load the model from a Hugging Face "
                     "directory (tokenizer.json) instead")

"""Streaming detokenization: token ids in, only the new text out.

The prefix/read-offset technique (as in vLLM and TGI): keep a small window of
tokens ``[prefix_offset, len)``; ``[prefix_offset, read_offset)`` has already
been turned into text. Each step decodes the window and the prefix part, and
the difference is the new text. Byte-level tokens can split a multi-byte
UTF-8 character; the decoder renders an incomplete trailing sequence as
U+FFFD, so a trailing U+FFFD run is held back until the next token completes
it (or until ``flush``). The window slides whenever its text ends on a whole
character, so each step decodes O(1) tokens, not the whole output.

Invariant: the concatenation of everything ``step`` and ``flush`` return
equals ``tokenizer.decode(output_ids, skip_special_tokens)`` for byte-level
tokenizers (the prompt tail only serves as left context, for tokenizers whose
decoder strips a leading space).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# prompt tokens kept as left context (enough for any leading-space rule)
_PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        # a prompt ending mid-character would swallow the output's first bytes
        # into the prompt's character: start without context then
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_len = len(self._decode(context)) if context else 0  # chars of decode(tokens[p:r])
        self._emitted = self._prefix_len  # chars of decode(tokens[p:]) already returned
        self._num_output_tokens = 0

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (possibly "")."""
        if not new_token_ids:
            return ""
        self._tokens.extend(new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        text = self._decode(self._tokens[self._prefix_offset:])
        stable = len(text.rstrip(REPLACEMENT_CHAR))
        # decoding a window can in principle render differently from its
        # prefix part; never go backwards
        delta = text[self._emitted:stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        if stable == len(text):  # window ends on a whole character: slide it
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            self._prefix_len = len(self._decode(self._tokens[self._prefix_offset:self._read_offset]))
            self._emitted = self._prefix_len
            self._trim()
        return delta

    def flush(self) -> str:
        """The held-back tail (incomplete UTF-8 at the end of the output), once."""
        text = self._decode(self._tokens[self._prefix_offset:])
        delta = text[self._emitted:]
        self._emitted = len(text)
        return delta

    def _trim(self) -> None:
        """Drop tokens before the window so memory stays O(window)."""
        if self._prefix_offset:
            del self._tokens[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

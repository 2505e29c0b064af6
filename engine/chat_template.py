"""Render a Hugging Face style chat template (Jinja2, sandboxed).

Mirrors what ``transformers`` does in ``apply_chat_template``: an immutable
sandboxed environment with ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, a ``raise_exception`` global (templates use it to
reject bad conversations), ``strftime_now`` and a ``tojson`` filter that keeps
non-ASCII characters.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template itself, or the template applied to these messages, failed."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template. Build once per tokenizer, render many times."""

    def __init__(self, source: str) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("the chat template is empty; give a Jinja2 template string")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not compile (line {e.lineno}): {e.message}") from e
        self.source = source

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               bos_token: str = "", eos_token: str = "", **kwargs: Any) -> str:
        validate_messages(messages)
        try:
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, **kwargs)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the messages: {e}") from e


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Check the OpenAI-style message list shape before rendering."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: give at least one {'role': 'user', 'content': ...} message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a non-empty string 'role' (e.g. 'user', 'assistant', 'system')")
        if "content" not in m and "tool_calls" not in m:
            raise ValueError(f"messages[{i}] (role {role!r}) needs a 'content' field")

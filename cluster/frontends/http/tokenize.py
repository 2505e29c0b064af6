"""POST /tokenize and POST /detokenize, as vLLM's OpenAI server has them.

/tokenize takes `prompt` (text; `add_special_tokens`, default true) or `messages` (rendered
with the model's chat template, as /v1/chat/completions does) and answers
{"count", "max_model_len", "tokens"}: exactly the ids a generation request with the same
input is served from. /detokenize takes `tokens` and answers {"prompt"}: their text, special
tokens included; ids the model accepts but the tokenizer has no token for (a padded
vocabulary) add no text.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from cluster.frontends.http.chat import message_text
from cluster.frontends.http.convert import bad
from cluster.frontends.http.openai_schema import ChatMessageIn
from cluster.frontends.http.state import EndpointState
from cluster.frontends.validation import ChatMessage, GenerateInput, ValidationError, prompt_token_ids


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TokenizeRequest(_In):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = None     # default: true for prompt, false for messages
    add_generation_prompt: bool = True         # the server's chat path always adds it


class DetokenizeRequest(_In):
    model: str | None = None
    tokens: list[int]


def tokenize(req: TokenizeRequest, state: EndpointState) -> dict[str, Any]:
    if (req.prompt is None) == (req.messages is None):
        raise bad("prompt", "give exactly one of prompt or messages")
    if not req.add_generation_prompt:
        raise bad("add_generation_prompt", "only true is supported (chat requests are served with it)")
    messages = None if req.messages is None else tuple(
        ChatMessage(m.role, message_text(i, m)) for i, m in enumerate(req.messages))
    inp = GenerateInput(prompt=req.prompt, messages=messages, add_special_tokens=req.add_special_tokens)
    limits = state.runner.limits
    try:
        ids = prompt_token_ids(inp, state.runner.backend.tokenizer(), limits)
    except ValidationError as e:
        raise bad(e.field, e.message) from None
    return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids}


def detokenize(req: DetokenizeRequest, state: EndpointState) -> dict[str, Any]:
    limit = state.runner.limits.vocab_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < limit:
            raise bad(f"tokens[{i}]", f"{t} is not a token id of this model (valid: 0..{limit - 1})")
    return {"prompt": state.runner.backend.tokenizer().decode(req.tokens, skip_special_tokens=False)}

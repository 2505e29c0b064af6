"""Transport-neutral request validation: a `GenerateInput` -> a `GenerateJob`.

Both frontends (gRPC, HTTP) convert their wire request into a `GenerateInput`
and call `validate_request`, which checks every field against `Limits`,
renders chat messages with the model's template, tokenizes, builds the
`SamplingParams` and computes the prompt's block hashes once for the router.
Any problem raises `ValidationError(field, message)`; the message says how to
fix the input, and the transport maps it to INVALID_ARGUMENT / HTTP 400.
"""
from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from cluster.orchestration.backend import GenerateJob, ModelInfoData
from engine import sampling_params as sp
from engine.block_hash import block_hashes

ROLES = ("system", "user", "assistant", "tool", "developer")
_ID_RE = re.compile(r"^[\x21-\x7e]*$")   # printable ASCII, no spaces
_SEED_MIN, _SEED_MAX = -(2 ** 63), 2 ** 63 - 1   # room for the engine's per-sample seed offsets


class ValidationError(ValueError):
    """Bad input. `field` names it as the client wrote it (e.g. 'sampling.top_p')."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class SamplingInput:
    """Sampling fields as the client sent them; None = not set (use the default)."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    include_stop_str_in_output: bool = False


@dataclass(frozen=True)
class GenerateInput:
    """One generation request, independent of the transport. Give exactly one of
    `prompt` (text; bytes are decoded as UTF-8), `prompt_token_ids`, `messages`."""
    request_id: str = ""
    prompt: str | bytes | None = None
    prompt_token_ids: Sequence[int] | None = None
    messages: Sequence[ChatMessage] | None = None
    sampling: SamplingInput = field(default_factory=SamplingInput)
    add_special_tokens: bool | None = None


@dataclass(frozen=True)
class Limits:
    """What the server accepts. `max_prompt_tokens` = max_model_len - 1 (one
    token must fit after the prompt)."""
    max_model_len: int
    block_size: int
    vocab_size: int
    max_n: int = sp.MAX_N
    max_stop_strings: int = sp.MAX_STOP_STRINGS
    max_stop_string_len: int = sp.MAX_STOP_STRING_LEN
    max_stop_token_ids: int = 64
    max_logprobs: int = sp.MAX_LOGPROBS
    max_messages: int = 256
    max_prompt_chars: int = 0              # 0 = 32 characters per context token
    max_id_len: int = 256                  # request_id and cache_salt
    roles: tuple[str, ...] = ROLES
    kv_cache_dtype: str = "auto"           # the workers' KV storage: part of every block hash

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len - 1

    @property
    def prompt_char_limit(self) -> int:
        return self.max_prompt_chars or 32 * self.max_model_len

    @classmethod
    def from_model(cls, info: ModelInfoData, **overrides: Any) -> "Limits":
        return cls(max_model_len=info.max_model_len, block_size=info.block_size,
                   vocab_size=info.vocab_size, kv_cache_dtype=info.kv_cache_dtype, **overrides)


def validate_request(req: GenerateInput, tokenizer, limits: Limits, *, cache_salt: str | None = None,
                     deadline: float | None = None, arrival_time: float | None = None) -> GenerateJob:
    """Check `req` and build the job. `cache_salt` is the final tenant salt: the
    caller decides whether it comes from the request or the authenticated key."""
    request_id = _check_id("request_id", req.request_id, limits) or f"req-{uuid.uuid4().hex}"
    salt = _check_id("cache_salt", cache_salt or "", limits, printable=False) or None
    prompt_ids, field_name = _prompt_token_ids(req, tokenizer, limits)
    if not prompt_ids:
        raise ValidationError(field_name, "the prompt is empty after tokenization; send some text")
    if len(prompt_ids) > limits.max_prompt_tokens:
        raise ValidationError(field_name, f"the prompt has {len(prompt_ids)} tokens; at most "
                              f"{limits.max_prompt_tokens} fit in this model's context of "
                              f"{limits.max_model_len} tokens; shorten it")
    sampling = build_sampling(req.sampling, len(prompt_ids), limits)
    extra = {} if arrival_time is None else {"arrival_time": arrival_time}
    return GenerateJob(request_id=request_id, prompt_token_ids=tuple(prompt_ids), sampling=sampling,
                       cache_salt=salt, deadline=deadline,
                       block_hashes=tuple(block_hashes(prompt_ids, limits.block_size, salt,
                                                       kv_cache_dtype=limits.kv_cache_dtype)), **extra)


def _check_id(name: str, value: str, limits: Limits, printable: bool = True) -> str:
    _check_text(name, value)
    if len(value) > limits.max_id_len:
        raise ValidationError(name, f"at most {limits.max_id_len} characters, got {len(value)}")
    if printable and not _ID_RE.match(value):
        raise ValidationError(name, "use printable ASCII without spaces (e.g. a UUID)")
    return value


def _check_text(name: str, value: Any) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValidationError(name, f"not valid UTF-8 (byte {e.start}); send UTF-8 text") from None
    if not isinstance(value, str):
        raise ValidationError(name, f"must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValidationError(name, f"not valid UTF-8 (character {e.start} is a lone surrogate); "
                              "send UTF-8 text") from None
    return value


def prompt_token_ids(req: GenerateInput, tokenizer, limits: Limits) -> list[int]:
    """The ids `req`'s prompt (text, ids or messages) becomes, exactly as a generation request's
    would (HTTP /tokenize); the length limits of a generation request are not applied."""
    return _prompt_token_ids(req, tokenizer, limits)[0]


def _prompt_token_ids(req: GenerateInput, tokenizer, limits: Limits) -> tuple[list[int], str]:
    given = [n for n in ("prompt", "prompt_token_ids", "messages") if getattr(req, n) is not None]
    if not given:
        raise ValidationError("prompt", "no prompt: give one of prompt, prompt_token_ids or messages")
    if len(given) > 1:
        raise ValidationError(given[1], f"give only one of prompt, prompt_token_ids, messages; got {given}")
    if req.prompt is not None:
        text = _check_text("prompt", req.prompt)
        if not text:
            raise ValidationError("prompt", "must not be empty")
        _check_chars("prompt", len(text), limits)
        add = True if req.add_special_tokens is None else bool(req.add_special_tokens)
        return list(tokenizer.encode(text, add_special_tokens=add)), "prompt"
    if req.prompt_token_ids is not None:
        return _check_token_ids("prompt_token_ids", req.prompt_token_ids, limits), "prompt_token_ids"
    return _render_messages(req, tokenizer, limits), "messages"


def _check_chars(name: str, n: int, limits: Limits) -> None:
    if n > limits.prompt_char_limit:
        raise ValidationError(name, f"{n} characters is more than the limit of {limits.prompt_char_limit}; "
                              "shorten it")


def _check_token_ids(name: str, ids: Sequence[int], limits: Limits) -> list[int]:
    out = list(ids)
    if len(out) > limits.max_prompt_tokens and name == "prompt_token_ids":
        raise ValidationError(name, f"{len(out)} tokens; at most {limits.max_prompt_tokens} fit in this "
                              f"model's context of {limits.max_model_len} tokens; shorten it")
    for i, t in enumerate(out):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.vocab_size:
            raise ValidationError(f"{name}[{i}]", f"{t!r} is not a token id of this model "
                                  f"(valid: 0..{limits.vocab_size - 1})")
    return out


def _render_messages(req: GenerateInput, tokenizer, limits: Limits) -> list[int]:
    msgs = list(req.messages or ())
    if not msgs:
        raise ValidationError("messages", "must hold at least one message")
    if len(msgs) > limits.max_messages:
        raise ValidationError("messages", f"{len(msgs)} messages; at most {limits.max_messages} are allowed")
    rendered = []
    for i, m in enumerate(msgs):
        role = _check_text(f"messages[{i}].role", m.role)
        if role not in limits.roles:
            raise ValidationError(f"messages[{i}].role", f"unknown role {role!r}; use one of "
                                  f"{', '.join(limits.roles)}")
        rendered.append({"role": role, "content": _check_text(f"messages[{i}].content", m.content)})
    _check_chars("messages", sum(len(m["content"]) for m in rendered), limits)
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
    except ValidationError:
        raise
    except Exception as e:  # template errors (raise_exception, missing template) are input errors
        raise ValidationError("messages", f"the chat template rejected them: {e}") from None
    add = False if req.add_special_tokens is None else bool(req.add_special_tokens)
    return list(tokenizer.encode(text, add_special_tokens=add))


def build_sampling(s: SamplingInput, prompt_len: int, limits: Limits) -> sp.SamplingParams:
    """Check the sampling fields (names as 'sampling.<field>') and build SamplingParams."""
    room = limits.max_model_len - prompt_len
    max_tokens = room if s.max_tokens is None else _int("max_tokens", s.max_tokens, 1, None)
    if max_tokens > room:
        raise ValidationError("sampling.max_tokens", f"{max_tokens} tokens do not fit: the prompt has "
                              f"{prompt_len} tokens and the context {limits.max_model_len}; ask for at most "
                              f"{room} or shorten the prompt")
    kw: dict[str, Any] = dict(max_tokens=max_tokens, ignore_eos=bool(s.ignore_eos),
                              include_stop_str_in_output=bool(s.include_stop_str_in_output))
    for name, lo, hi in (("temperature", 0.0, None), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0),
                         ("repetition_penalty", 0.0, None), ("frequency_penalty", -2.0, 2.0),
                         ("presence_penalty", -2.0, 2.0)):
        v = getattr(s, name)
        if v is not None:
            kw[name] = _float(name, v, lo, hi)
    if "top_p" in kw and kw["top_p"] <= 0.0:
        raise ValidationError("sampling.top_p", "must be in (0, 1]; use 1.0 to disable it")
    if "repetition_penalty" in kw and kw["repetition_penalty"] <= 0.0:
        raise ValidationError("sampling.repetition_penalty", "must be > 0 (1.0 disables it)")
    if s.top_k is not None:
        kw["top_k"] = _int("top_k", s.top_k, 0, None)
    if s.n is not None:
        kw["n"] = _int("n", s.n, 1, limits.max_n)
    if s.logprobs is not None:
        kw["logprobs"] = _int("logprobs", s.logprobs, 0, limits.max_logprobs)
    if s.seed is not None:
        kw["seed"] = _int("seed", s.seed, _SEED_MIN, _SEED_MAX)
    kw["stop"] = _stops(s.stop, limits)
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        raise ValidationError("sampling.stop_token_ids", f"{len(s.stop_token_ids)} stop token ids; at most "
                              f"{limits.max_stop_token_ids} are allowed")
    kw["stop_token_ids"] = tuple(_check_token_ids("sampling.stop_token_ids", s.stop_token_ids, limits))
    try:
        return sp.SamplingParams(**kw)
    except ValueError as e:   # the engine's own checks, should ours ever lag behind
        msg = str(e)
        first = msg.split(" ", 1)[0]
        name = first if first in kw else ("stop" if "stop string" in msg else "")
        raise ValidationError(f"sampling.{name}" if name else "sampling", msg) from None


def _stops(stops: Sequence[str], limits: Limits) -> tuple[str, ...]:
    stops = [stops] if isinstance(stops, (str, bytes)) else list(stops)
    if len(stops) > limits.max_stop_strings:
        raise ValidationError("sampling.stop", f"{len(stops)} stop strings; at most "
                              f"{limits.max_stop_strings} are allowed")
    out = []
    for i, s in enumerate(stops):
        text = _check_text(f"sampling.stop[{i}]", s)
        if not text or len(text) > limits.max_stop_string_len:
            raise ValidationError(f"sampling.stop[{i}]", f"must be 1 to {limits.max_stop_string_len} "
                                  f"characters, got {len(text)}")
        out.append(text)
    return tuple(out)


def _int(name: str, v: Any, lo: int | None, hi: int | None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise ValidationError(f"sampling.{name}", f"must be an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise ValidationError(f"sampling.{name}", f"must be {rng}, got {v}")
    return v


def _float(name: str, v: Any, lo: float | None, hi: float | None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValidationError(f"sampling.{name}", f"must be a finite number, got {v!r}")
    v = float(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValidationError(f"sampling.{name}", f"must be {rng}, got {v}")
    return v

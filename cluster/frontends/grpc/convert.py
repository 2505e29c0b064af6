"""pdserve.v1 protobuf <-> the transport-neutral request/chunk objects.

Requests are deserialized here rather than by grpc: a request that does not
parse (most often a string field holding invalid UTF-8) becomes a `BadRequest`
naming the field, which the servicer answers with INVALID_ARGUMENT instead of
grpc's generic INTERNAL "Exception deserializing request".
"""
from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from cluster.pb import generation_pb2 as pb
from cluster.frontends.runner import Chunk
from cluster.frontends.validation import ChatMessage, GenerateInput, SamplingInput


@dataclass(frozen=True)
class BadRequest:
    field: str
    message: str


def deserialize_generate(data: bytes) -> pb.GenerateRequest | BadRequest:
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError:
        path = find_bad_utf8(data, pb.GenerateRequest.DESCRIPTOR)
        if path:
            return BadRequest(path.replace("messages.messages", "messages"),
                              "not valid UTF-8; send UTF-8 text (or token ids for raw input)")
        return BadRequest("request", "cannot parse it as a pdserve.v1.GenerateRequest; regenerate the "
                          "client from proto/pdserve/v1/generation.proto")


def find_bad_utf8(data: bytes, desc: Descriptor, prefix: str = "") -> str | None:
    """Path of the first string field (recursing into messages) whose bytes are not UTF-8."""
    pos, seen = 0, {}
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            num, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            elif wire == 2:
                size, pos = _varint(data, pos)
                body, pos = data[pos:pos + size], pos + size
                f = desc.fields_by_number.get(num)
                if f is None:
                    continue
                name = prefix + f.name
                if _is_repeated(f):
                    seen[num] = seen.get(num, -1) + 1
                    name += f"[{seen[num]}]"
                if f.type == FieldDescriptor.TYPE_STRING:
                    body.decode("utf-8")
                elif f.type == FieldDescriptor.TYPE_MESSAGE:
                    inner = find_bad_utf8(body, f.message_type, name + ".")
                    if inner:
                        return inner
            else:
                return None
    except UnicodeDecodeError:
        return name
    except IndexError:
        return None
    return None


def _is_repeated(f: FieldDescriptor) -> bool:
    rep = getattr(f, "is_repeated", None)   # protobuf >= 6; `label` before
    return bool(rep) if rep is not None else f.label == f.LABEL_REPEATED


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        b = data[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
        shift += 7


def _opt(msg, name: str):
    return getattr(msg, name) if msg.HasField(name) else None


def to_input(req: pb.GenerateRequest) -> GenerateInput:
    s = req.sampling
    sampling = SamplingInput(
        max_tokens=_opt(s, "max_tokens"), temperature=_opt(s, "temperature"), top_p=_opt(s, "top_p"),
        top_k=s.top_k, min_p=s.min_p, seed=_opt(s, "seed"), n=_opt(s, "n"), stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos, logprobs=_opt(s, "logprobs"),
        repetition_penalty=_opt(s, "repetition_penalty"), frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty, include_stop_str_in_output=s.include_stop_str_in_output)
    which = req.WhichOneof("input")
    kw: dict = {}
    if which == "prompt":
        kw["prompt"] = req.prompt
    elif which == "prompt_token_ids":
        kw["prompt_token_ids"] = tuple(req.prompt_token_ids.ids)
    elif which == "messages":
        kw["messages"] = tuple(ChatMessage(m.role, m.content) for m in req.messages.messages)
    return GenerateInput(request_id=req.request_id, sampling=sampling,
                         add_special_tokens=_opt(req, "add_special_tokens"), **kw)


def to_response(c: Chunk) -> pb.GenerateResponse:
    r = pb.GenerateResponse(request_id=c.request_id, index=c.index, token_ids=c.token_ids, text=c.text,
                            finish_reason=c.finish_reason or "")
    if isinstance(c.stop_reason, str):
        r.stop_string = c.stop_reason
    elif isinstance(c.stop_reason, int):
        r.stop_token_id = c.stop_reason
    if c.first or c.finish_reason:
        r.usage.prompt_tokens = c.prompt_tokens
        r.usage.completion_tokens = c.completion_tokens
        r.usage.cached_tokens = c.cached_tokens
        r.timing.elapsed_s = c.elapsed_s
        if c.time_to_first_token_s is not None:
            r.timing.time_to_first_token_s = c.time_to_first_token_s
    for lp in c.logprobs:
        r.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                       top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    return r

"""A small async client for the pdserve gRPC endpoint (CLI, tests, load tests).

    async with GenerationClient("127.0.0.1:50051", api_key=None) as c:
        async for r in c.generate(prompt="Hello", max_tokens=16, temperature=0):
            print(r.text, end="")
        done = await c.complete(prompt="Hello", max_tokens=16)   # collected
        info = await c.model_info(); status = await c.health()

RPC errors surface as grpc.aio.AioRpcError (`.code()`, `.details()`,
`.trailing_metadata()` carries `retry-after-ms` on RESOURCE_EXHAUSTED).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterable, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.pb import generation_pb2 as pb
from cluster.pb import generation_pb2_grpc as pb_grpc

SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)


@dataclass(frozen=True)
class ClientTls:
    """Server CA (None = system roots); cert + key for mutual TLS."""
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        read = (lambda p: Path(p).read_bytes() if p else None)
        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file), read(self.cert_file))


@dataclass
class Completion:
    """All chunks of one Generate call, joined per sequence index."""
    request_id: str = ""
    texts: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    usage: dict[int, pb.Usage] = field(default_factory=dict)
    time_to_first_token_s: float | None = None
    chunks: int = 0

    @property
    def text(self) -> str:
        return self.texts.get(0, "")

    @property
    def tokens(self) -> list[int]:
        return self.token_ids.get(0, [])

    @property
    def finish_reason(self) -> str:
        return self.finish_reasons.get(0, "")

    def add(self, r: pb.GenerateResponse) -> None:
        self.request_id = r.request_id
        self.chunks += 1
        self.texts[r.index] = self.texts.get(r.index, "") + r.text
        self.token_ids.setdefault(r.index, []).extend(r.token_ids)
        if r.HasField("timing") and r.timing.time_to_first_token_s and self.time_to_first_token_s is None:
            self.time_to_first_token_s = r.timing.time_to_first_token_s
        if r.finish_reason:
            self.finish_reasons[r.index] = r.finish_reason
            self.usage[r.index] = r.usage


def build_request(prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
                  messages: Iterable[Mapping[str, str] | tuple[str, str]] | None = None,
                  request_id: str = "", cache_salt: str = "", add_special_tokens: bool | None = None,
                  **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from keyword arguments; sampling fields are pb.SamplingParams' names."""
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling fields {sorted(unknown)}; valid: {sorted(SAMPLING_FIELDS)}")
    req = pb.GenerateRequest(request_id=request_id, cache_salt=cache_salt,
                             sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}))
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    if prompt is not None:
        req.prompt = prompt
    if prompt_token_ids is not None:
        req.prompt_token_ids.ids.extend(prompt_token_ids)
    if messages is not None:
        for m in messages:
            role, content = (m["role"], m["content"]) if isinstance(m, Mapping) else m
            req.messages.messages.add(role=role, content=content)
    return req


class GenerationClient:
    def __init__(self, target: str, *, api_key: str | None = None, tls: ClientTls | None = None,
                 options: Sequence[tuple[str, object]] = ()) -> None:
        self.target = target
        self.channel = (grpc.aio.secure_channel(target, tls.credentials(), options=options) if tls
                        else grpc.aio.insecure_channel(target, options=options))
        self.stub = pb_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {api_key}"),) if api_key else ())

    async def __aenter__(self) -> "GenerationClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(self, request: pb.GenerateRequest | None = None, *, timeout: float | None = None,
                       **kwargs) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the response chunks. Leaving the loop early cancels the call (and the request)."""
        req = request if request is not None else build_request(**kwargs)
        call = self.stub.Generate(req, timeout=timeout, metadata=self.metadata)
        try:
            async for r in call:
                yield r
        finally:
            call.cancel()   # no-op once the call has finished

    async def complete(self, request: pb.GenerateRequest | None = None, *, timeout: float | None = None,
                       **kwargs) -> Completion:
        out = Completion()
        async for r in self.generate(request, timeout=timeout, **kwargs):
            out.add(r)
        return out

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfoResponse:
        return await self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        """'SERVING', 'NOT_SERVING', ... of the standard grpc.health.v1 service."""
        r = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until the channel connects (raises TimeoutError)."""
        await asyncio.wait_for(self.channel.channel_ready(), timeout)

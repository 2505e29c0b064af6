"""Optional API keys for the gRPC endpoint, and TLS / mutual TLS credentials.

Keys come from a file (one `key tenant` per line, `#` comments) or the env
variable PDSERVE_API_KEYS (`key:tenant` pairs separated by commas or
whitespace; a key without a tenant is its own tenant, under a hashed name).
Clients send metadata `authorization: Bearer <key>`. Every RPC except the
grpc.health.v1 service needs a valid key when keys are configured; the
tenant of the key then scopes the prefix-cache salt.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import grpc

ENV_VAR = "PDSERVE_API_KEYS"
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class ApiKeys:
    """sha256(key) -> tenant. Lookups compare digests, not the keys themselves."""
    tenants: Mapping[bytes, str]

    @classmethod
    def parse(cls, pairs: list[tuple[str, str | None]]) -> "ApiKeys":
        out: dict[bytes, str] = {}
        for key, tenant in pairs:
            if not key:
                raise ValueError("an API key must not be empty")
            out[_digest(key)] = tenant or "key-" + _digest(key).hex()[:12]
        if not out:
            raise ValueError("no API keys given; add `key tenant` lines or unset the option")
        return cls(out)

    @classmethod
    def from_file(cls, path: str | Path) -> "ApiKeys":
        pairs = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) > 2:
                raise ValueError(f"{path}:{n}: write `key tenant` (two words), got {len(parts)} words")
            pairs.append((parts[0], parts[1] if len(parts) == 2 else None))
        return cls.parse(pairs)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ApiKeys | None":
        text = (os.environ if env is None else env).get(ENV_VAR, "").strip()
        if not text:
            return None
        pairs = [(p.split(":", 1)[0], p.split(":", 1)[1] if ":" in p else None)
                 for p in re.split(r"[,\s]+", text) if p]
        return cls.parse(pairs)

    def tenant(self, metadata) -> str | None:
        """The tenant of the request's `authorization: Bearer <key>`, or None."""
        for k, v in metadata or ():
            if k.lower() == "authorization":
                value = v.decode() if isinstance(v, bytes) else v
                scheme, _, key = value.strip().partition(" ")
                if scheme.lower() == "bearer" and key.strip():
                    return self.tenants.get(_digest(key.strip()))
        return None


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    msg = "missing or invalid API key; send metadata `authorization: Bearer <key>`"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

    streaming = unary   # a coroutine serves streaming responses too (nothing is written)

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every non-health RPC without a valid key with UNAUTHENTICATED."""

    def __init__(self, keys: ApiKeys, on_reject=None) -> None:
        self.keys = keys
        self._on_reject = on_reject or (lambda method: None)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(EXEMPT_PREFIXES):
            return handler
        if self.keys.tenant(handler_call_details.invocation_metadata) is not None:
            return handler
        self._on_reject(method)
        return _deny(handler)


@dataclass(frozen=True)
class TlsConfig:
    """Server certificate and key (PEM files); a client CA turns on mutual TLS."""
    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key = Path(self.cert_file).read_bytes(), Path(self.key_file).read_bytes()
        ca = Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=ca is not None)

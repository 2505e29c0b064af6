"""API keys and TLS on the gRPC port: an interceptor over `cluster.frontends.auth.ApiKeys`,
and server credentials from a `TlsConfig`.

Every RPC except the grpc.health.v1 service needs a valid key when keys are
configured (metadata `authorization: Bearer <key>`); others get UNAUTHENTICATED.
"""
from __future__ import annotations

import grpc

from cluster.frontends.auth import ApiKeys, TlsConfig

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


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


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    cert, key, ca = tls.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

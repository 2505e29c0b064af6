"""The gRPC frontend: pdserve.v1.Generation + grpc.health.v1 + reflection.

    runner = RequestRunner.from_config(backend, config, metrics)   # backend started; shared with HTTP
    server = await serve_grpc(runner, config)                       # config.host:config.grpc_port
    print(server.port); ...; await server.set_serving(False); await server.stop(grace=30)

Status codes: bad input -> INVALID_ARGUMENT (message names the field), full
-> RESOURCE_EXHAUSTED with trailing metadata `retry-after-ms`, deadline
(client's or `request_timeout`) -> DEADLINE_EXCEEDED, draining ->
UNAVAILABLE, a BackendError -> its own code. A client that cancels closes the
backend stream, which aborts the request and frees its blocks; so does a client
that accepts no response for `stream_write_timeout` seconds (one stuck in
flow control, or one whose close grpc never turned into a cancellation of the
handler): that call ends CANCELLED.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.config import ServeConfig
from cluster.frontends.auth import ApiKeys, TlsConfig
from cluster.frontends.grpc.auth import AuthInterceptor, server_credentials
from cluster.frontends.grpc.convert import BadRequest, deserialize_generate, to_input, to_response
from cluster.frontends.ports import PortClaims
from cluster.frontends.runner import RequestRunner, outcome_of
from cluster.frontends.validation import ValidationError
from cluster.orchestration.backend import BackendError
from cluster.pb import generation_pb2 as pb
from cluster.version import version

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name   # "pdserve.v1.Generation"


def _status(code: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL)


class ClientGone(Exception):
    """A response write failed or made no progress for `stream_write_timeout`: the
    client is gone, or reads nothing."""


class GenerationServicer:
    def __init__(self, runner: RequestRunner, keys: ApiKeys | None, write_timeout: float = 30.0) -> None:
        self.runner = runner                 # in-flight tracking, deadline, admission: shared with HTTP
        self.keys = keys
        self.write_timeout = write_timeout   # seconds one response write may take; 0 = no bound
        self.serving = True

    def _cache_salt(self, request: pb.GenerateRequest, context) -> str | None:
        if self.keys is None:
            return request.cache_salt or None
        tenant = self.keys.tenant(context.invocation_metadata())   # the interceptor checked it
        if tenant is None:   # pragma: no cover - unreachable behind the interceptor
            raise BackendError("UNAUTHENTICATED", "missing or invalid API key")
        return f"{tenant}/{request.cache_salt}" if request.cache_salt else tenant

    @staticmethod
    def _client_deadline(context) -> float | None:
        """The client's timeout as a time.monotonic() instant (the runner applies and enforces it)."""
        remaining = context.time_remaining()
        return None if remaining is None or math.isinf(remaining) else time.monotonic() + remaining

    async def _write(self, context, response) -> None:
        """context.write, bounded. grpc.aio cancels a handler on a client's close only if
        core reports a cancel before any status went out; otherwise it drops the handler,
        which then waits in a write (holding its admission slot and KV blocks) until the
        garbage collector finds it. A write that takes `write_timeout` ends the call."""
        try:
            async with asyncio.timeout(self.write_timeout or None):
                await context.write(response)
        except TimeoutError:
            raise ClientGone(f"the client accepted no response for {self.write_timeout:g} s "
                             "(stream_write_timeout); read the stream or raise the limit") from None
        except Exception as e:   # grpc's ExecuteBatchError: the call is closed
            raise ClientGone(f"the response could not be written: {type(e).__name__}") from e

    def _count(self, exc: BaseException) -> None:
        self.runner.metrics.requests.labels(outcome=outcome_of(exc)).inc()

    async def Generate(self, request, context) -> None:
        with self.runner.track():
            await self._generate(request, context)

    async def _generate(self, request, context) -> None:
        # context.write, not `yield`: a cancelled call then cancels this coroutine, so the
        # aclosing() below closes the runner (and the backend stream) at once, not at GC.
        if isinstance(request, BadRequest):
            err = ValidationError(request.field, request.message)
            self._count(err)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if not self.serving:
            err = BackendError("UNAVAILABLE", "the server is draining; send the request to another replica")
            self._count(err)
            await context.abort(grpc.StatusCode.UNAVAILABLE, err.message)
        try:
            inp = to_input(request)
            salt = self._cache_salt(request, context)
            stream = self.runner.run(inp, cache_salt=salt, deadline=self._client_deadline(context))
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    await self._write(context, to_response(chunk))
        except ClientGone as e:   # the stream is closed (request aborted); end the call if it still can
            log.info("Generate %s: %s", request.request_id or "(no id)", e)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await context.abort(grpc.StatusCode.CANCELLED, str(e))
        except ValidationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except BackendError as e:
            hint = () if e.retry_after_s is None else (
                ("retry-after-ms", str(max(1, round(e.retry_after_s * 1000)))),)
            await context.abort(_status(e.code), e.message, trailing_metadata=hint)
        except Exception as e:
            if isinstance(e, grpc.aio.AbortError):
                raise
            log.exception("Generate failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")

    async def ModelInfo(self, request, context) -> pb.ModelInfoResponse:
        try:
            info = self.runner.backend.model_info()
        except BackendError as e:
            await context.abort(_status(e.code), e.message)
        lim = self.runner.limits
        return pb.ModelInfoResponse(model_name=info.model_name, max_model_len=info.max_model_len,
                                    block_size=info.block_size, vocab_size=info.vocab_size,
                                    pools=dict(info.pools), max_prompt_tokens=lim.max_prompt_tokens,
                                    max_stop_strings=lim.max_stop_strings, max_n=lim.max_n, version=version(),
                                    tokenizer_vocab_size=info.tokenizer_vocab_size or info.vocab_size)


def _generic_handler(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=deserialize_generate,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.ModelInfo, request_deserializer=pb.ModelInfoRequest.FromString,
            response_serializer=pb.ModelInfoResponse.SerializeToString),
    })


@dataclass
class GrpcServer:
    server: grpc.aio.Server
    port: int
    host: str
    health: health.aio.HealthServicer
    servicer: GenerationServicer
    runner: RequestRunner

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def serving(self) -> bool:
        return self.servicer.serving

    async def set_serving(self, serving: bool) -> None:
        """Readiness: NOT_SERVING (and UNAVAILABLE for new Generate calls) while draining."""
        self.servicer.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        """Drain, then stop. Readiness turns NOT_SERVING at once and the server keeps
        answering (health: NOT_SERVING, new Generate calls: UNAVAILABLE) while the calls
        in flight finish, for at most `grace` seconds; then it stops, cancelling what is
        left. A load balancer polling health thus sees NOT_SERVING, not a dead socket."""
        t0 = time.monotonic()
        await self.set_serving(False)
        await self.runner.wait_idle(grace)
        left = None if grace is None else max(0.0, grace - (time.monotonic() - t0))
        await self.server.stop(left)
        await self.runner.wait_cleanups(timeout=left)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def serve_grpc(runner: RequestRunner, config: ServeConfig, *, api_keys: ApiKeys | None = None,
                     tls: TlsConfig | None = None, claim: PortClaims | None = None) -> GrpcServer:
    """Start the gRPC endpoint on config.host:config.grpc_port (0 = any free port) over `runner`
    (the process's one runner: the HTTP endpoint may share it). Keys and TLS are off unless given.
    `claim`: the port's claim (cluster/frontends/ports.py), released just before the server binds.
    The server binds without SO_REUSEPORT (gRPC's default turns it on), so a second server on a
    port one already serves is refused instead of silently taking half its connections."""
    servicer = GenerationServicer(runner, api_keys, config.stream_write_timeout)
    server = grpc.aio.server(interceptors=_interceptors(runner, api_keys), options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((_generic_handler(servicer),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.grpc_port}"
    if claim is not None:
        claim.release_grpc()
    credentials = server_credentials(tls) if tls else None
    try:
        port = (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    except RuntimeError:    # grpcio raises where older versions returned 0
        port = 0
    if port == 0:
        raise RuntimeError(f"cannot bind the gRPC endpoint to {address} (in use?); pick a free --grpc-port "
                           "(0 turns gRPC off in `pdserve serve`)")
    await server.start()
    out = GrpcServer(server, port, config.host, health_servicer, servicer, runner)
    await out.set_serving(True)
    log.info("gRPC endpoint on %s (tls=%s, api keys=%s)", out.target, tls is not None, api_keys is not None)
    return out


def _interceptors(runner: RequestRunner, api_keys: ApiKeys | None) -> list[grpc.aio.ServerInterceptor]:
    if api_keys is None:
        return []
    reject = (lambda method: runner.metrics.requests.labels(outcome="unauthenticated").inc())
    return [AuthInterceptor(api_keys, on_reject=reject)]

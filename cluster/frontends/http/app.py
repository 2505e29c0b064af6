"""The OpenAI-compatible FastAPI app, built per server by `create_app` (no module state).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}], GET /version,
POST /tokenize and /detokenize (vLLM's; cluster/frontends/http/tokenize.py),
GET /health (liveness: 200 while the process serves HTTP), GET /ready
(readiness: 503 while draining), GET /metrics (the process's Prometheus
registry, the same one the metrics port serves). With API keys configured
every /v1 route needs `Authorization: Bearer <key>`; the key's tenant (plus
`user`, if sent) is the prefix-cache salt. Without keys `user` is the salt.
"""
from __future__ import annotations

import re
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.frontends.auth import ApiKeys
from cluster.frontends.http.chat import create_chat_completion
from cluster.frontends.http.completions import create_completion
from cluster.frontends.http.errors import OpenAIError
from cluster.frontends.http.openai_schema import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from cluster.frontends.http.state import EndpointState
from cluster.frontends.http.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from cluster.frontends.runner import RequestRunner
from cluster.version import version

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_OUTCOME = {400: "invalid_argument", 401: "unauthenticated", 404: "not_found", 503: "unavailable"}
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|dict|list|[A-Z].*|.*\[.*)$")


def create_app(runner: RequestRunner, *, model_name: str | None = None, model_names: tuple[str, ...] = (),
               api_keys: ApiKeys | None = None, write_timeout: float = 0.0) -> FastAPI:
    """An app over `runner` (the process's one runner, shared with the gRPC endpoint when it runs:
    one router, validator, admission, deadline, metrics). `model_names`: every name a request may
    give (aliases); the first is the one listed."""
    names = tuple(model_names) or (model_name or runner.backend.model_info().model_name,)
    state = EndpointState(runner, names[0], aliases=names[1:], api_keys=api_keys, write_timeout=write_timeout)
    app = FastAPI(title="pdserve OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.state.pdserve = state
    _add_error_handlers(app, state)
    gate = _Gate(state)
    _add_generation_routes(app, state, gate)
    _add_tokenizer_routes(app, state, gate)
    _add_model_routes(app, state, gate)
    _add_probe_routes(app, state)
    return app


class _Gate:
    """What every /v1 request passes: the API key (a route dependency), draining, the model name."""

    def __init__(self, state: EndpointState) -> None:
        self.state = state

    def tenant(self, request: Request) -> str | None:
        keys = self.state.api_keys
        if keys is None:
            return None
        found = keys.tenant(request.headers.items())
        if found is None:
            raise OpenAIError(401, "missing or invalid API key; send the header `Authorization: Bearer <key>`",
                              code="invalid_api_key")
        return found

    def salt(self, found: str | None, user: str | None) -> str | None:
        if self.state.api_keys is None:
            return user or None
        return f"{found}/{user}" if user else found

    def admit(self, model: str | None) -> None:
        if not self.state.serving:
            raise OpenAIError(503, "the server is draining; send the request to another replica",
                              code="unavailable")
        if model is not None and not self.state.serves(model):
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                              f"{self.state.model_name!r} (GET /v1/models)", param="model", code="model_not_found")


def _add_generation_routes(app: FastAPI, state: EndpointState, gate: _Gate) -> None:
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, found: str | None = Depends(gate.tenant)) -> Response:
        gate.admit(req.model)
        return create_completion(req, state, gate.salt(found, req.user))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, found: str | None = Depends(gate.tenant)) -> Response:
        gate.admit(req.model)
        return create_chat_completion(req, state, gate.salt(found, req.user))


def _add_tokenizer_routes(app: FastAPI, state: EndpointState, gate: _Gate) -> None:
    @app.post("/tokenize", dependencies=[Depends(gate.tenant)])
    async def tokenize_route(req: TokenizeRequest) -> dict[str, Any]:
        gate.admit(req.model)
        return tokenize(req, state)

    @app.post("/detokenize", dependencies=[Depends(gate.tenant)])
    async def detokenize_route(req: DetokenizeRequest) -> dict[str, Any]:
        gate.admit(req.model)
        return detokenize(req, state)


def _add_model_routes(app: FastAPI, state: EndpointState, gate: _Gate) -> None:
    def card() -> ModelCard:
        return ModelCard(id=state.model_name, created=state.created,
                         max_model_len=state.runner.limits.max_model_len)

    @app.get("/v1/models", dependencies=[Depends(gate.tenant)])
    async def models() -> dict[str, Any]:
        return ModelList(data=[card()]).model_dump()

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(gate.tenant)])
    async def model(model_id: str) -> dict[str, Any]:
        if not state.serves(model_id):
            raise OpenAIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return card().model_dump()


def _add_probe_routes(app: FastAPI, state: EndpointState) -> None:
    """Unauthenticated: version, liveness, readiness (503 while draining), Prometheus."""
    @app.get("/version")
    async def server_version() -> dict[str, str]:
        return {"version": version()}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if state.serving:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "draining"}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_error_handlers(app: FastAPI, state: EndpointState) -> None:
    def count(request: Request, status: int, outcome: str | None = None) -> None:
        if request.url.path in GENERATION_PATHS:
            state.count(outcome or _OUTCOME.get(status, "internal"))

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        count(request, exc.status, exc.outcome)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            err = OpenAIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "))
        else:
            param = loc_to_param(first.get("loc", ()))
            err = OpenAIError(400, f"{param or 'body'}: {first.get('msg')}", param=param)
        count(request, 400)
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                           headers=exc.headers).response()


def loc_to_param(loc) -> str | None:
    """pydantic's error location ('body', 'messages', 0, 'content') -> 'messages[0].content'
    (union-member tags such as 'list[int]' are dropped)."""
    out = ""
    for part in list(loc)[1:] if loc and loc[0] == "body" else list(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and not _TYPE_TAG.match(part):
            out += ("." if out else "") + part
        else:
            break
    return out or None

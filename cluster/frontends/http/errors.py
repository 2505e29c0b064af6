"""Errors in the OpenAI format, and the HTTP status of every failure.

`{"error": {"message", "type", "param", "code"}}` with: 400 invalid input
(`param` names the field as the client wrote it), 401 missing / invalid API
key, 404 unknown model or route, 409 duplicate request id, 429 admission
control said "busy" (with `Retry-After` seconds and `retry-after-ms`), 503
draining or no worker, 504 deadline passed, 500 anything else.
"""
from __future__ import annotations

import logging
import math
import re
from typing import Mapping

from fastapi.responses import JSONResponse

from cluster.orchestration.backend import BackendError
from cluster.frontends.http.openai_schema import ErrorBody, ErrorResponse
from cluster.frontends.validation import ValidationError

log = logging.getLogger(__name__)

_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401,
           "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "RESOURCE_EXHAUSTED": 429,
           "CANCELLED": 499, "UNIMPLEMENTED": 501, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
         404: "invalid_request_error", 409: "invalid_request_error", 429: "rate_limit_error",
         503: "service_unavailable_error", 504: "timeout_error"}


class OpenAIError(Exception):
    """An error answered as-is: status, message, param, code, extra headers."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None, outcome: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.outcome = outcome      # pdserve_requests{outcome} label when counted by the app

    def body(self) -> ErrorResponse:
        kind = _TYPE.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return ErrorResponse(error=ErrorBody(message=self.message, type=kind, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def openai_param(field: str, renames: Mapping[str, str] | None = None, prompt_index: int | None = None) -> str:
    """The validator's field name ('sampling.top_p', 'prompt_token_ids[3]', 'cache_salt') as the
    HTTP client wrote it ('top_p', 'prompt[3]', 'user')."""
    f = field.removeprefix("sampling.")
    for src in ("prompt_token_ids", "prompt"):
        if f == src or f.startswith(src + "["):
            base = "prompt" if prompt_index is None else f"prompt[{prompt_index}]"
            return base + f[len(src):]
    head = re.split(r"[\[.]", f, maxsplit=1)[0]
    renames = {"cache_salt": "user", **(renames or {})}
    return renames[head] + f[len(head):] if head in renames else f


def to_openai_error(exc: BaseException, renames: Mapping[str, str] | None = None) -> OpenAIError:
    """Any failure of a generation request -> the error the client sees."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValidationError):
        param = openai_param(exc.field, renames, getattr(exc, "prompt_index", None))
        return OpenAIError(400, f"{param}: {exc.message}", param=param)
    if isinstance(exc, BackendError):
        status = _STATUS.get(exc.code, 500)
        headers: dict[str, str] = {}
        if exc.code == "RESOURCE_EXHAUSTED":
            if exc.retry_after_s is None:   # too big for this server at any time: retrying cannot help
                return OpenAIError(400, exc.message, param=(renames or {}).get("max_tokens", "max_tokens"),
                                   code="request_too_large")
            headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s))),
                       "retry-after-ms": str(max(1, round(exc.retry_after_s * 1000)))}
        return OpenAIError(status, exc.message, code=exc.code.lower(), headers=headers)
    log.error("HTTP generation failed", exc_info=exc)
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal")

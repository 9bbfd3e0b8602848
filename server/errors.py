"""Error shapes and exception handlers: every failure leaves the server as an OpenAI error body.

The body is always `{"error": {"message", "type", "param", "code"}}` whatever raised it: our own
`APIError`, a typed engine error (`engine.api.errors.EngineError`, mapped by `ENGINE_STATUS`), a pydantic /
FastAPI validation failure (400 with the offending `param`, never FastAPI's default 422), garbage
JSON, an unknown route, or an unexpected bug (500, logged with its traceback). A 429 carries
`Retry-After`. Handlers never touch the engine, so a bad request changes nothing.
"""

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.api.errors import (
    EngineError,
    EngineUnavailable,
    IncompatibleState,
    PromptTooLong,
    QueueFull,
    RequestNotFound,
    SequenceBusy,
    SequenceNotFound,
    StorageFull,
)
from engine.api.lora import AdapterBusy, AdapterMemoryFull, AdapterNotFound

log = logging.getLogger("cellserve.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "invalid_request_error",  # an HTTP method the server does not know (server.http_edge)
    503: "unavailable_error",
    507: "server_error",  # the state dir refused a save (disk full)
}
RETRY_AFTER_S = 1
# The one place an engine error becomes an HTTP status (subclasses inherit; anything else is a 400).
ENGINE_STATUS: dict[type[EngineError], int] = {
    SequenceNotFound: 404,
    RequestNotFound: 404,
    SequenceBusy: 409,
    PromptTooLong: 400,  # OpenAI's and vLLM's answer to a context overflow (clients look for a 400)
    QueueFull: 429,
    EngineUnavailable: 503,
    IncompatibleState: 409,  # an archive of another model: it conflicts with the model this server runs
    StorageFull: 507,  # a save the state dir refused; nothing was lost
    AdapterNotFound: 404,
    AdapterBusy: 409,  # an unload while requests run under the adapter
    AdapterMemoryFull: 507,  # --max-loras / --max-lora-memory full of adapters in use; nothing was unloaded
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error response: `{"error": {"message", "type", "param", "code"}}` (OpenAI's shape)."""

    error: ErrorDetail


# What the OpenAPI schema documents for every route (FastAPI's default 422 is never sent: see below).
ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorBody, "description": why} for status, why in (
        (400, "invalid request: the message says which field and why (param); also context_length_exceeded"),
        (401, "missing or wrong API key"),
        (404, "unknown route, sequence or request id"),
        (405, "method not allowed on this route"),
        (409, "the sequence is busy generating"),
        (413, "request body over --max-body-bytes"),
        (429, "waiting queue full; retry after Retry-After seconds"),
        (500, "internal error (a bug; logged)"),
        (503, "loading, shutting down, or the engine stopped"),
        (507, "the state dir refused a save (disk full); the sequence is intact in memory"),
    )
}


def without_422(schema: dict) -> dict:
    """Validation failures are 400s here, never FastAPI's 422: drop 422 from every operation."""
    for path in schema.get("paths", {}).values():
        for op in path.values():
            if isinstance(op, dict):
                op.get("responses", {}).pop("422", None)
    return schema


class APIError(Exception):
    """An HTTP-level failure with a status, a message saying what to do, and the offending param."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or ERROR_TYPES.get(status, "error")

    @classmethod
    def from_engine(cls, err: EngineError) -> "APIError":
        status = next((ENGINE_STATUS[c] for c in type(err).__mro__ if c in ENGINE_STATUS), 400)
        return cls(status, str(err), param=err.param, code=err.code)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else None


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    err_type = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


def as_api_error(exc: BaseException) -> APIError:
    """Any exception as an APIError; unknown ones become a 500 that names the exception class."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        return APIError.from_engine(exc)
    return APIError(500, f"internal error ({type(exc).__name__}: {exc}); see the server log", code="internal")


def param_from_loc(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'; None for the body itself."""
    parts = [p for p in loc if p != "body"] if loc and loc[0] == "body" else list(loc[1:])
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first validation failure as a 400 naming its field, input and fix."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {}).get("error", "")
        return APIError(400, f"request body is not valid JSON ({ctx}); send a JSON object", code="invalid_json")
    cause = first.get("ctx", {}).get("error")
    param = getattr(cause, "param", None) or param_from_loc(loc)
    msg = str(cause) if isinstance(cause, Exception) else first.get("msg", "invalid value")
    if first.get("type") == "missing":
        text = f"missing required field '{param}'" if param else "missing request body; send a JSON object"
    elif param is None:
        text = f"request body must be a JSON object: {msg}"
    else:
        text = f"invalid value for '{param}': {msg}"
        if "input" in first and first.get("type") != "value_error":
            text += f" (got {_short(first['input'])})"
    extra = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return APIError(400, text + extra, param=param, code="invalid_value")


def _short(value: Any, limit: int = 80) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


UNCOUNTED_PATHS = ("/health", "/metrics")  # probes: a 503 there is the answer, not a failed request


def _respond(request: Request, err: APIError) -> JSONResponse:
    ctx = getattr(request.app.state, "ctx", None)
    if ctx is not None and request.url.path not in UNCOUNTED_PATHS:
        ctx.metrics.errors.labels(status=str(err.status)).inc()
    return error_response(err)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception class the app can see to the one error shape (and count it)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _respond(request, exc)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return _respond(request, APIError.from_engine(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _respond(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message, code = str(exc.detail), None
        if exc.status_code == 404:
            message, code = f"no route {request.method} {request.url.path}; see GET /docs for the API", "not_found"
        elif exc.status_code == 405:
            message, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
        elif exc.status_code == 413:
            code = "body_too_large"
        return _respond(request, APIError(exc.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _respond(request, as_api_error(exc))

"""What guards every request before a route runs: the API-key dependency, HEAD routed as GET, the
request-body size limit (413, unread; `server.limits.Limits.max_body_bytes`), the OpenAI routes also
served without `/v1` (`WithoutV1`) and cross-origin requests (`cors`, Starlette's CORSMiddleware)."""

import hmac
import json

from fastapi import Request
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, error_body
from server.limits import Limits
from server.state import ServerContext

# The OpenAI routes that are also served without their `/v1` (as llama.cpp's server, vLLM and SGLang do), so
# an SDK whose base_url lacks `/v1` works: `/chat/completions` is `/v1/chat/completions`, `/responses/{id}` is
# `/v1/responses/{id}`, and so on. llama.cpp's own `/completion` (singular) is a route of its own.
OPENAI_ROOTS = ("/chat/completions", "/completions", "/models", "/responses", "/embeddings", "/rerank", "/score")
# Response headers a page on another origin may read (CORS `Access-Control-Expose-Headers`).
EXPOSED_HEADERS = ("X-Request-Id", "Retry-After", "Content-Type")


async def require_api_key(request: Request) -> None:
    """`Authorization: Bearer <key>` or `x-api-key: <key>` when the server has a key; constant-time compare."""
    expected = ServerContext.of(request).api_key
    if not expected:
        return
    token = request.headers.get("x-api-key")
    if token is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token if scheme.lower() == "bearer" else ""
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>' (or "
                       "'x-api-key: <key>') with the key the server was started with (--api-key)",
                       code="invalid_api_key")


class WithoutV1:
    """ASGI middleware: a request for one of `OPENAI_ROOTS` without the `/v1` prefix is routed as the `/v1`
    route it stands for (path and raw_path rewritten before routing, so the API key, the limits, the error
    shapes and the docs are the `/v1` route's own; the OpenAPI schema lists each route once)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _openai_root(scope["path"]):
            raw = scope.get("raw_path")
            scope = {**scope, "path": "/v1" + scope["path"], "raw_path": b"/v1" + raw if raw else raw}
        await self.app(scope, receive, send)


def _openai_root(path: str) -> bool:
    return any(path == root or path.startswith(root + "/") for root in OPENAI_ROOTS)


def cors_options(origins: list[str]) -> dict:
    """Starlette `CORSMiddleware` options for `--cors-origins`: the preflight (`OPTIONS`) is answered by the
    middleware before any route or key check; any method and request header; `EXPOSED_HEADERS` readable
    (an SSE stream's `X-Request-Id` for a cancel). Credentials (cookies) are allowed only for listed
    origins, never with `*` (browsers refuse that pair, and it would hand any site the user's session)."""
    wildcard = "*" in origins
    return {"allow_origins": ["*"] if wildcard else list(origins), "allow_methods": ["*"], "allow_headers": ["*"],
            "allow_credentials": not wildcard, "expose_headers": list(EXPOSED_HEADERS), "max_age": 600}


class HeadAsGet:
    """ASGI middleware: a HEAD request is routed as the GET it stands for (HEAD-based health checks);
    the server (uvicorn) still sees HEAD in its own scope and sends the headers without the body."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


class FormBodyAsJson:
    """ASGI middleware: a body sent as `application/x-www-form-urlencoded` (what `curl -d '{...}'` sends without
    `-H 'Content-Type: application/json'`, as llama.cpp's and vLLM's examples are often typed) is read as JSON:
    no route here takes a form, and llama-server reads every body as JSON whatever its type. A body that is not
    JSON is then the usual 400 saying so."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and any(k == b"content-type" and _is_form(v) for k, v in scope["headers"]):
            headers = [(k, b"application/json" if k == b"content-type" else v) for k, v in scope["headers"]]
            scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)


def _is_form(content_type: bytes) -> bool:
    return content_type.split(b";")[0].strip().lower() == b"application/x-www-form-urlencoded"


class BodySizeLimit:
    """ASGI middleware: refuse request bodies over `limits.max_body_bytes` with 413, unread, and close the
    connection (`Connection: close`); the HTTP edge then reads and drops what the client still sends for
    a bounded time so the client reads the 413 (`server.http_edge`, lingering close)."""

    def __init__(self, app: ASGIApp, limits: Limits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limits.max_body_bytes:
            await _send_413(send, self.limits.body_too_large(declared))
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limits.max_body_bytes:
                    raise HTTPException(413, self.limits.body_too_large())
            return message

        async def closing(message: Message) -> None:  # past the limit: the rest of the body is not wanted
            if message["type"] == "http.response.start" and received > self.limits.max_body_bytes:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, counted, closing)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_413(send: Send, message: str) -> None:
    body = json.dumps(error_body(413, message, code="body_too_large")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})

"""What guards every request before a route runs: the API-key dependency, HEAD routed as GET, and the
request-body size limit (413, unread; `server.limits.Limits.max_body_bytes`)."""

import hmac
import json

from fastapi import Request
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, error_body
from server.limits import Limits
from server.state import ServerContext


async def require_api_key(request: Request) -> None:
    """`Authorization: Bearer <key>` when the server has a key; constant-time compare."""
    expected = ServerContext.of(request).api_key
    if not expected:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>' with the "
                       "key the server was started with (--api-key)", code="invalid_api_key")


class HeadAsGet:
    """ASGI middleware: a HEAD request is routed as the GET it stands for (HEAD-based health checks);
    the server (uvicorn) still sees HEAD in its own scope and sends the headers without the body."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


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

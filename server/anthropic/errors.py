"""Anthropic's error shape and API key on the Messages routes.

Guarantees:
- Every error answered on a `/v1/messages` path, whatever raised it (validation, the API key, the body
  size limit, the queue, the engine, an unknown sub-route), has Anthropic's body
  `{"type": "error", "error": {"type": ..., "message": ...}}` with the same status; `AnthropicErrors`
  (an ASGI middleware, outermost) rewrites the one error shape the app builds (`server.errors`), so
  there is a single status mapping. A stream's mid-way error is an `event: error` (see routes).
- `--api-key` is checked from `x-api-key` (what the `anthropic` SDK sends) or `Authorization: Bearer`.
"""

import hmac
import json

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError
from server.state import ServerContext

PATH = "/v1/messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


async def require_key(request: Request) -> None:
    """`x-api-key: <key>` or `Authorization: Bearer <key>` when the server has a key; constant-time compare."""
    expected = ServerContext.of(request).api_key
    if not expected:
        return
    token = request.headers.get("x-api-key")
    if token is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token if scheme.lower() == "bearer" else ""
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(401, "missing or wrong API key; send the header 'x-api-key: <key>' (or 'Authorization: "
                       "Bearer <key>') with the key the server was started with (--api-key)", code="invalid_api_key")


def _rewrite(body: bytes, status: int) -> bytes:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace") or f"HTTP {status}"
    return json.dumps(anthropic_error(status, message)).encode()


class AnthropicErrors:
    """ASGI middleware: JSON error responses on `/v1/messages` paths get Anthropic's shape."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH):
            await self.app(scope, receive, send)
            return
        held: Message | None = None
        chunks: list[bytes] = []

        async def rewriting(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] >= 400 and \
                    dict(message.get("headers", [])).get(b"content-type", b"").startswith(b"application/json"):
                held = message
                return
            if message["type"] == "http.response.body" and held is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                body = _rewrite(b"".join(chunks), held["status"])
                headers = [(k, v) for k, v in held.get("headers", []) if k != b"content-length"]
                await send({**held, "headers": headers + [(b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, rewriting)

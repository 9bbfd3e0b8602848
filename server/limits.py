"""Request limits checked at the edge, before any expensive work: one source for each limit.

Guarantees:
- A body larger than `max_body_bytes` is refused with 413 before it is read: at once when its
  `Content-Length` says so, else as soon as the bytes received pass the limit (chunked uploads), so a
  20 MB body never costs 20 MB of parsing, tokenization or memory.
- A request with more prompts than `max_prompts`, or more choices (prompts x n) than `max_choices`,
  is a 400 naming the field before anything is tokenized or submitted.
- Text that cannot fit the model's context whatever it tokenizes to is refused before tokenization
  (see `TokenizerService`); the exact token check against the context and the pool comes after.
"""

import json
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, error_body

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
DEFAULT_MAX_PROMPTS = 256
DEFAULT_MAX_CHOICES = 1024


@dataclass(frozen=True)
class Limits:
    """What one request may ask for. `cellserve serve --max-body-bytes/--max-prompts/--max-choices`."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompts: int = DEFAULT_MAX_PROMPTS
    max_choices: int = DEFAULT_MAX_CHOICES

    def check_choices(self, n_prompts: int, n: int) -> None:
        if n_prompts > self.max_prompts:
            raise APIError(400, f"{n_prompts} prompts in one request; at most {self.max_prompts} are allowed "
                           "(--max-prompts): split the request", param="prompt", code="too_many_prompts")
        if n_prompts * n > self.max_choices:
            raise APIError(400, f"{n_prompts} prompts x n={n} = {n_prompts * n} choices in one request; at most "
                           f"{self.max_choices} are allowed (--max-choices): lower n or send fewer prompts",
                           param="n", code="too_many_choices")

    def body_too_large(self, size: int | None = None) -> str:
        got = f" ({size} bytes)" if size is not None else ""
        return (f"request body is too large{got}: at most {self.max_body_bytes} bytes are accepted "
                "(--max-body-bytes); send a shorter prompt")


class BodySizeLimit:
    """ASGI middleware: refuse request bodies over `limits.max_body_bytes` with 413, unread."""

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

        await self.app(scope, counted, send)


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

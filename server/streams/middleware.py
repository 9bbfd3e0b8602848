"""Resumable streams (llama.cpp's): a streamed request (`"stream": true`) that carries `X-Conversation-Id` keeps
generating when its client goes away, and every byte of its SSE answer is kept in the conversation's kept stream
(server.streams.kept), so a reloaded page reads it again from any offset (`GET /v1/stream`) and a stop
(`DELETE /v1/stream`) cancels it.

`ResumableStreams` is ASGI middleware, so every streaming route (chat, completions, responses, messages,
llama.cpp's /completion) gets it the same way: for such a request the app's `receive` reports no disconnect
until the kept stream is stopped (then it reports one, and the route cancels its engine request as for a client
that left), its writes go to the kept stream as well as to the client, and a write to a client that left is
dropped. A request without the header, or one that does not stream, is passed through untouched.
"""

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.streams.kept import KeptStream, KeptStreams

HEADER = b"x-conversation-id"


class ResumableStreams:
    def __init__(self, app: ASGIApp, kept_streams: KeptStreams):
        self.app = app
        self.kept_streams = kept_streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        conversation = _header(scope, HEADER) if scope["type"] == "http" and scope["method"] == "POST" else None
        if not conversation:
            await self.app(scope, receive, send)
            return
        try:
            body = await _read_body(receive)
        except Exception as exc:  # noqa: BLE001 -- e.g. the body limit's 413: the app's own read raises it
            await self.app(scope, _raising(exc), send)
            return
        if body is None:  # the client left before its request was whole: nothing to answer
            return
        if not _streams(body):
            await self.app(scope, _replaying(body, receive), send)
            return
        kept = self.kept_streams.open(conversation)
        tee = _Tee(send, kept, self.kept_streams)
        try:
            await self.app(scope, _detached(body, kept), tee)
            await tee.close()
        finally:
            kept.finish()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1").strip() or None
    return None


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body; None if the client left first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _streams(body: bytes) -> bool:
    try:
        return json.loads(body).get("stream") is True
    except (ValueError, AttributeError):
        return False


def _raising(exc: Exception) -> Receive:
    async def receive() -> Message:
        raise exc
    return receive


def _replaying(body: bytes, receive: Receive) -> Receive:
    """The body already read, then the client's own messages (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return replay


def _detached(body: bytes, kept: KeptStream) -> Receive:
    """The body, then a disconnect only when the kept stream is stopped: the client leaving changes nothing."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await kept.cancelled.wait()
        return {"type": "http.disconnect"}
    return receive


class _Tee:
    """The app's `send` for a resumable request: writes go to the kept stream (an SSE answer's body) and to the
    client while it is there. An answer that is not an event stream (an error before streaming began) leaves
    nothing to replay: its kept stream is dropped. `close` ends a stream the app left unfinished (a stop cancelled
    it), so a client still reading sees the stream end rather than a broken connection."""

    def __init__(self, send: Send, kept: KeptStream, kept_streams: KeptStreams):
        self.send, self.kept, self.kept_streams = send, kept, kept_streams
        self.client = True
        self.streaming = False
        self.complete = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.streaming = _content_type(message).startswith(b"text/event-stream")
            if not self.streaming:
                self.kept_streams.drop(self.kept)
        elif message["type"] == "http.response.body":
            self.complete = not message.get("more_body", False)
            if self.streaming:
                self.kept.append(message.get("body", b""))
        await self._to_client(message)

    async def close(self) -> None:
        if self.streaming and not self.complete:
            self.complete = True
            await self._to_client({"type": "http.response.body", "body": b"", "more_body": False})

    async def _to_client(self, message: Message) -> None:
        if self.client:
            try:
                await self.send(message)
            except OSError:  # the client went away: the kept stream still gets every byte
                self.client = False


def _content_type(message: Message) -> bytes:
    return next((v for k, v in message.get("headers", []) if k.lower() == b"content-type"), b"")

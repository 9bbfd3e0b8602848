"""Server-sent events: exact `data: {json}\\n\\n` framing and cancel-on-disconnect.

`SSEResponse` streams an async iterator of already-built payloads (dicts become one JSON event,
the literal `DONE` becomes `data: [DONE]`). It always races the stream against the client's
`http.disconnect`, even under ASGI 2.4 servers where Starlette's `StreamingResponse` would only
notice a dropped client at its next write: a request still waiting in the queue (nothing to write
yet) must be cancelled as soon as its client leaves. When the client goes, the body iterator is
cancelled and closed, so its `finally` runs and cancels the engine request (cells freed next tick).
JSON encoding happens here, on the asyncio thread, never on the engine's loop thread.

`NamedEventStream` is the same with named events (`event: <type>` then `data: {json}`, no `[DONE]`),
which is what the `openai` Responses and the `anthropic` stream parsers read.
"""

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from server.generation.driver import wait_disconnect

DONE = object()  # sentinel payload: the terminating `data: [DONE]` event
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
# OpenAPI: a generation route answers 200 as JSON, or as an SSE stream when the body says `stream: true`.
STREAMED_200 = {200: {"description": "the response; with `stream: true` a server-sent event stream",
                      "content": {"text/event-stream": {"schema": {}}}}}


# Characters JSON may leave raw that line splitters other than SSE's own (Python's str.splitlines, httpx's
# iter_lines, some browsers' JS before ES2019) take for line ends: escaped, an event is always one line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event_json(payload: Any) -> bytes:
    """`payload` as one line of compact JSON for an SSE `data:` field: non-ASCII kept as is, except the three
    Unicode line breaks that JSON leaves raw, escaped (`\\u2028` decodes to the same string)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS).encode()


def encode_event(payload: Any) -> bytes:
    """One SSE event: `data: <json>\\n\\n` (or `data: [DONE]\\n\\n`)."""
    if payload is DONE:
        return b"data: [DONE]\n\n"
    return b"data: " + event_json(payload) + b"\n\n"


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response whose producer is cancelled the moment the client disconnects.

    `if_unstarted`: called when the response ends without its producer ever having run (the client left
    before the first event was asked for): a generator that never started cannot run its own `finally`,
    so what it would have cleaned up (the run it streams) is cleaned up here."""

    media_type = "text/event-stream"

    def __init__(self, payloads: AsyncIterator[Any], *, headers: dict[str, str] | None = None,
                 encode: Callable[[Any], bytes] = encode_event, if_unstarted: Callable[[], None] | None = None):
        self._payloads = payloads
        self._if_unstarted = if_unstarted
        self._started = False
        super().__init__(self._encoded(payloads, encode), headers={**SSE_HEADERS, **(headers or {})})

    async def _encoded(self, payloads: AsyncIterator[Any], encode: Callable[[Any], bytes]) -> AsyncIterator[bytes]:
        self._started = True  # no await before the producer starts: from here on its `finally` is its own
        async for payload in payloads:
            yield encode(payload)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away between our disconnect check and a write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await wait_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._close_producer()

    async def _close_producer(self) -> None:
        for it in (self.body_iterator, self._payloads):
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()
        if not self._started and self._if_unstarted is not None:
            self._if_unstarted()


def encode_named(event: tuple[str, dict]) -> bytes:
    name, data = event
    return f"event: {name}\ndata: ".encode() + event_json(data) + b"\n\n"


class NamedEventStream(SSEResponse):
    """An SSE stream of `(event name, payload)` pairs, with `SSEResponse`'s cancel-on-disconnect."""

    def __init__(self, events: AsyncIterator[tuple[str, dict]], *, headers: dict[str, str] | None = None,
                 encode: Callable[[tuple[str, dict]], bytes] = encode_named,
                 if_unstarted: Callable[[], None] | None = None):
        super().__init__(events, headers=headers, encode=encode, if_unstarted=if_unstarted)

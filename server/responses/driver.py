"""One generation answered from its whole text: what `/v1/responses` and `/v1/messages` share.

Both APIs build their answer from one choice's accumulated text (split into text and tool calls), so
they drive a `GenerationRun` the same way, and both stream named SSE events (`event: <type>` then
`data: {json}`, no `[DONE]`), which is what the `openai` Responses and the `anthropic` stream parsers
read. Guarantees, the same as `server.openai.response.serve`'s:
- `start` admits the run or raises the engine's typed error (QueueFull -> 429, PromptTooLong -> 400, ...);
  a client gone before that leaves nothing behind (499, nothing sent).
- `collect` waits for the run while watching for the client to leave (it then cancels the run: cells
  freed at the next tick); `outputs` (the streaming side) closes the run in its `finally`, which runs
  when the client drops the stream too (`SSEResponse` cancels the producer).
- The run is registered for `POST /v1/requests/{id}/cancel` while it lives.
"""

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response
from starlette.responses import StreamingResponse

from engine.api.outputs import RequestOutput
from server.openai.generation import ClientGone, GenerationRun, await_or_disconnect
from server.openai.sse import SSE_HEADERS, SSEResponse, event_json
from server.state import ServerContext

GONE = 499  # nginx's "client closed request": nothing is sent, the status is only logged


@dataclass
class Output:
    """One choice's output so far (choice 0: these APIs generate one answer per request)."""

    text: str = ""
    n_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine found in the prefix cache
    finish_reason: str | None = None  # stop | length | cancelled | error
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None
    last_token: int | None = None
    pieces: list[tuple[str, int]] = field(default_factory=list)  # (text, tokens) of each output, in order

    def add(self, out: RequestOutput) -> str:
        """Fold in one engine output; returns the new text."""
        self.cached_tokens = out.cached_tokens
        new, n = "", 0
        for co in out.outputs:
            new += co.text
            n += len(co.token_ids)
            if co.token_ids:
                self.last_token = co.token_ids[-1]
            if co.finish_reason:
                self.finish_reason, self.stop_reason, self.error = co.finish_reason, co.stop_reason, co.error
        self.text += new
        self.n_tokens += n
        self.pieces.append((new, n))
        return new

    @property
    def last_tokens(self) -> int:
        """Tokens of the output `add` folded in last."""
        return self.pieces[-1][1] if self.pieces else 0

    @property
    def ended_on_stop_token(self) -> bool:
        """The last token is a stop token (EOS, a stop token id, or the EOS a complete grammar took),
        which stays in a sequence's history; a stop *string* is cut from the text and is not one."""
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str) and self.last_token is not None


async def start(request: Request, ctx: ServerContext, run: GenerationRun) -> Response | None:
    """Submit the run; None once admitted (and registered), a 499 if the client left meanwhile."""
    try:
        await await_or_disconnect(request, run.start(), run.close)
    except ClientGone:
        return Response(status_code=GONE)
    ctx.register(run)
    return None


async def collect(request: Request, ctx: ServerContext, run: GenerationRun, output: Output) -> Response | None:
    """Wait for the whole output; None when it is in `output`, a 499 if the client left first."""

    async def consume() -> None:
        async for _, out in run.events():
            output.add(out)

    try:
        await await_or_disconnect(request, consume(), run.close)
    except ClientGone:
        return Response(status_code=GONE)
    finally:
        run.close()
        ctx.unregister(run)
    return None


async def outputs(ctx: ServerContext, run: GenerationRun) -> AsyncIterator[RequestOutput]:
    """The run's outputs for a stream; the run is closed (unfinished work cancelled) however it ends."""
    try:
        async for _, out in run.events():
            yield out
    finally:
        run.close()
        ctx.unregister(run)


def encode_named(event: tuple[str, dict]) -> bytes:
    name, data = event
    return f"event: {name}\ndata: ".encode() + event_json(data) + b"\n\n"


class NamedEventStream(SSEResponse):
    """An SSE stream of `(event name, payload)` pairs, with `SSEResponse`'s cancel-on-disconnect."""

    def __init__(self, events: AsyncIterator[tuple[str, dict]], *, headers: dict[str, str] | None = None,
                 encode: Callable[[tuple[str, dict]], bytes] = encode_named):
        self._payloads = events

        async def encoded() -> AsyncIterator[bytes]:
            async for event in events:
                yield encode(event)

        StreamingResponse.__init__(self, encoded(), headers={**SSE_HEADERS, **(headers or {})})

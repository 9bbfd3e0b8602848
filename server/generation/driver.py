"""The one run driver: how every route drives a `GenerationRun` from admission to its last output, whatever
shape it answers in (OpenAI chunks, Responses or Anthropic events, a sequence continuation).

Guarantees:
- `start` admits the run or raises the engine's typed error (QueueFull -> 429, PromptTooLong -> 400,
  SequenceBusy -> 409, ...); a client gone before that leaves nothing behind (`GONE`, nothing sent).
  An admitted run is registered for `POST /v1/requests/{id}/cancel` until it is finished.
- `collect` (a whole answer) folds every output in while watching for the client to leave (it then
  cancels the run: cells freed at the next tick, and answers `GONE`).
- `streamed` (a stream's body) hands the outputs to the body and, however the body ends (done, an
  error, the client dropping the stream: `SSEResponse` closes the producer), closes the run.
- `finish` is that one ending: the run is closed (what is unfinished is cancelled and counted) and
  unregistered; it is idempotent, so a route may also call it on its own error paths.

A client that leaves is noticed one way (`wait_disconnect`, the ASGI `http.disconnect`), whether a
route is waiting on the engine (`await_or_disconnect`, which raises `ClientGone`; routes that wait on
a sequence verb use it too) or streaming (`server.generation.sse`).
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive

from engine.api.outputs import RequestOutput
from server.generation.run import GenerationRun
from server.state import ServerContext

GONE = 499  # nginx's "client closed request": nothing is sent, the status is only logged
Fold = Callable[[int, RequestOutput], None]  # (prompt index, output) -> None: folds one output into an answer


async def start(request: Request, ctx: ServerContext, run: GenerationRun) -> Response | None:
    """Submit the run; None once admitted (and registered), a `GONE` response if the client left meanwhile."""
    try:
        await await_or_disconnect(request, run.start(), run.close)
    except ClientGone:
        return Response(status_code=GONE)
    ctx.register(run)
    return None


async def collect(request: Request, ctx: ServerContext, run: GenerationRun, fold: Fold) -> Response | None:
    """Fold in every output; None when the run is done, a `GONE` response if the client left first."""

    async def consume() -> None:
        async for k, out in run.events():
            fold(k, out)

    try:
        await await_or_disconnect(request, consume(), run.close)
    except ClientGone:
        return Response(status_code=GONE)
    finally:
        finish(ctx, run)
    return None


@contextlib.asynccontextmanager
async def streamed(ctx: ServerContext, run: GenerationRun) -> AsyncIterator[AsyncIterator[tuple[int, RequestOutput]]]:
    """`async with streamed(ctx, run) as events`: the run's `(prompt index, output)` pairs for a stream body;
    the run is finished when the block is left, however it is left."""
    events = run.events()
    try:
        yield events
    finally:
        try:
            await events.aclose()
        finally:
            finish(ctx, run)


def finish(ctx: ServerContext, run: GenerationRun) -> None:
    """The run's end: cancel what is unfinished (counted as cancelled) and unregister it."""
    run.close()
    ctx.unregister(run)


class ClientGone(Exception):
    """The HTTP client disconnected while we were waiting on the engine."""


async def await_or_disconnect(request: Request, work: Awaitable, on_disconnect) -> Any:
    """Await `work`, but if the client disconnects first: call `on_disconnect()` and raise ClientGone.

    Listens for the ASGI `http.disconnect` message (the body has already been read, so the next
    message can only be that) instead of polling `request.is_disconnected()`: it reacts at once and
    costs nothing while waiting.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        on_disconnect()
        raise
    gone = watcher.done()  # checked before the watcher is cancelled below
    watcher.cancel()
    if task.done() and not gone:
        return task.result()
    # The client is gone (even if the work finished in the same turn: nobody would read the answer).
    task.cancel()
    on_disconnect()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone()


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client disconnects: the one way both a waiting route and a stream notice it
    (the body has been read, so the next ASGI message can only be `http.disconnect`)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return

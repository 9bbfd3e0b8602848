"""`serve`: a run answered in OpenAI's shapes through its `Formatter`, as one JSON body or an event stream
(`/v1/completions`, `/v1/chat/completions` and sequence continuations), driven by `server.generation.driver`.

Guarantees of `serve`:
- Non-streaming: the route waits for every choice while watching for the client to leave; if it
  leaves, the engine requests are cancelled (cells freed at the next tick) and nothing is sent.
- Streaming: chunks in OpenAI's shapes, `data: [DONE]` last; an engine failure mid-stream becomes a
  `data: {"error": {...}}` event followed by `[DONE]`; a dropped client cancels the engine requests.
- Both: the run is registered under its request id for `POST /v1/requests/{id}/cancel` while it
  lives and unregistered after; the `X-Request-Id` header carries the id.
"""

import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from server.errors import APIError, as_api_error, error_body
from server.generation import driver
from server.generation.formatter import Formatter, usage_chunk
from server.generation.run import GenerationRun
from server.generation.sse import DONE, SSEResponse
from server.generation.telemetry import verbose_of
from server.state import ServerContext

log = logging.getLogger("cellserve.server")


async def serve(request: Request, ctx: ServerContext, run: GenerationRun, fmt: Formatter, *,
                stream: bool) -> Response:
    """Start the run (typed engine errors become 4xx/5xx here) and answer in the asked-for mode."""
    gone = await driver.start(request, ctx, run)
    if gone is not None:
        return gone
    headers = {"X-Request-Id": run.request_id}
    if stream:
        return SSEResponse(_stream(ctx, run, fmt), headers=headers, if_unstarted=lambda: driver.finish(ctx, run))
    gone = await driver.collect(request, ctx, run, fmt.fold)
    if gone is not None:
        return gone
    failed = [s for s in fmt.states.values() if s.finish_reason == "error"]
    if failed:
        raise APIError(500, f"generation failed: {failed[0].error or 'engine error'}", code="engine_error")
    body = fmt.final()
    if fmt.verbose_prompt is not None:
        first = fmt.ordered()[0]
        body["__verbose"] = verbose_of(fmt.verbose_prompt, first.text, run.prompt_tokens(), len(first.token_ids),
                                       sum(fmt.cached.values()))
    return JSONResponse(fmt.telemetry.stamp(body, final=True) if fmt.telemetry else body, headers=headers)


async def _stream(ctx: ServerContext, run: GenerationRun, fmt: Formatter) -> AsyncIterator:
    try:
        async with driver.streamed(ctx, run) as events:
            for c in fmt.opening_chunks():
                yield c
            started: set[tuple[int, int]] = set()
            tel = fmt.telemetry
            async for k, out in events:
                fmt.note(k, out)
                if fmt.progress is not None:
                    yield fmt.progress_chunk(fmt.progress)
                for co in out.outputs:
                    first = (k, co.index) not in started
                    started.add((k, co.index))
                    st = fmt.apply(k, co)
                    if co.finish_reason == "error":
                        yield error_body(500, f"generation failed: {co.error or 'engine error'}", code="engine_error")
                        yield DONE
                        return
                    if co.text or co.token_ids or co.finish_reason or (first and st.prefix):
                        delta = fmt.delta_chunk(st, co, first)
                        if delta is not None:
                            last = co.finish_reason is not None and not fmt.include_usage
                            yield tel.stamp(delta, final=last) if tel else delta
        if fmt.include_usage:
            use = usage_chunk(fmt.chunk_object, run.request_id, fmt.created, fmt.model, fmt.total_usage())
            yield tel.stamp(use, final=True) if tel else use
    except Exception as exc:  # any failure must reach the client as an error event
        err = as_api_error(exc)
        if err.status >= 500:
            log.exception("stream %s failed", run.request_id)
        yield err.body()
    finally:
        driver.finish(ctx, run)  # also when the stream failed before its first output
    yield DONE

"""OpenAI's Responses API on persistent sequences: `POST /v1/responses`, `GET /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`, `DELETE /v1/responses/{id}`.

A stored response (`store`, the default) is a prefix of a persistent sequence (`server.responses.store`):
`previous_response_id` appends only the new turn to it, or forks it when that response was already
continued (`server.responses.turns`). Every limit of the chat route applies: the body size, the
context and pool fit (400 `context_length_exceeded` before any sequence is made), the queue (429),
and a client that leaves cancels the generation (and what the turn made is undone).
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from engine.api.errors import EngineError, SequenceNotFound
from engine.api.ids import new_id
from engine.api.sampling_params import SamplingParams
from server.errors import APIError, as_api_error
from server.generation import driver
from server.generation.driver import ClientGone
from server.generation.lora import lora_ref
from server.generation.output import Output
from server.generation.reasoning import template_kwargs
from server.generation.reply import Reply, reply_of
from server.generation.run import GenerationRun
from server.generation.sampling import build_sampling_params
from server.generation.sse import STREAMED_200, NamedEventStream
from server.generation.telemetry import Telemetry
from server.generation.toolcalls import ToolPlan, chat_template_of
from server.responses.items import item_dict, page
from server.responses.protocol import ResponsesRequest
from server.responses.saved import ResponseFiles
from server.responses.shapes import ResponseBuilder, usage
from server.responses.store import ResponseStore, Stored
from server.responses.turns import Turn, plan, settle
from server.state import ServerContext

router = APIRouter()
log = logging.getLogger("cellserve.server")


def store_of(request: Request) -> ResponseStore:
    state = request.app.state
    store = getattr(state, "response_store", None)
    if store is None:
        ctx = ServerContext.of(request)
        files = ResponseFiles(ctx.state_dir) if ctx.state_dir is not None else None
        store = state.response_store = ResponseStore(ctx.limits.max_stored_responses, files)
    return store


def sampling(body: ResponsesRequest, max_tokens: int, guided: dict | None) -> SamplingParams:
    kwargs = {"max_tokens": max_tokens, "lora": lora_ref(body.model), "report_progress": body.wants_progress()}
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    return build_sampling_params(kwargs, guided)


@router.post("/v1/responses", responses=STREAMED_200)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    store = store_of(request)
    prev = store.get(body.previous_response_id, param="previous_response_id") if body.previous_response_id else None
    mode, name = body.tool_mode()
    tools = ToolPlan([t.as_tool() for t in body.tools or ()], mode, name, parallel=body.parallel_tool_calls,
                     chat_template=chat_template_of(ctx.tokens))
    guided = tools.guided(body.guided())
    effort = body.reasoning.effort if body.reasoning is not None else None
    kwargs = template_kwargs(chat_template_of(ctx.tokens), None, effort, None)
    try:
        turn, max_tokens = await plan(request, ctx, store, inputs=body.messages(), instructions=body.instructions,
                                      tools=tools.prompting(), prev=prev, keep=body.store,
                                      max_tokens=body.max_output_tokens, template_kwargs=kwargs)
    except ClientGone:
        return Response(status_code=driver.GONE)
    rid = new_id("resp", sep="_")  # OpenAI's shape
    run = None
    try:
        reply = await reply_of(ctx, tools, turn.append)
        run = GenerationRun(engine, rid, [turn.append], sampling(body, max_tokens, guided), seq_id=turn.seq_id,
                            metrics=ctx.metrics)
        gone = await driver.start(request, ctx, run)
    except BaseException:
        await settle(ctx, store, turn, None, run)
        raise
    if gone is not None:
        await settle(ctx, store, turn, None, run)
        return gone
    builder = ResponseBuilder(rid, body, model=ctx.model_name, max_output_tokens=max_tokens)
    tel = Telemetry(len(turn.append), per_token=body.timings_per_token) if body.wants_telemetry() else None
    headers = {"X-Request-Id": rid}
    items = [item_dict(item) for item in body.input]
    if body.stream:
        return NamedEventStream(_stream(ctx, store, run, turn, builder, reply, body.store, items, tel), headers=headers,
                                if_unstarted=lambda: _settle_later(ctx, store, run, turn, None))
    output = Output()
    try:
        gone = await driver.collect(request, ctx, run, output.fold)
    except BaseException:
        await settle(ctx, store, turn, None, run)
        raise
    if gone is not None:
        await settle(ctx, store, turn, None, run)
        return gone
    reasoning, content, calls = reply.split(output.text)
    use = usage(turn.input_tokens, turn.cached_tokens(output.cached_tokens), output.n_tokens,
                reply.reasoning_tokens(output.pieces))
    answer = builder.final(output, content, calls, use, reasoning)
    said = {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": calls}
    await settle(ctx, store, turn, _record(ctx, turn, rid, output, said, answer, body.store, items), run)
    if output.finish_reason == "error":
        raise APIError(500, f"generation failed: {output.error or 'engine error'}", code="engine_error")
    return JSONResponse(answer, headers=headers)


async def _stream(ctx: ServerContext, store: ResponseStore, run: GenerationRun, turn: Turn,
                  builder: ResponseBuilder, reply: Reply, keep: bool,
                  items: list[dict], tel: Telemetry | None = None) -> AsyncIterator[tuple[str, dict]]:
    """The Responses event stream; `tel`: llama.cpp's telemetry asked for (`prompt_progress` as
    `response.in_progress` events, `timings` on the text deltas with `timings_per_token` and on
    `response.completed`)."""
    output, parser = Output(), reply.stream()
    shown, thought = "", ""
    record = None
    try:
        async with driver.streamed(ctx, run) as outs:
            for event in builder.opening():
                yield event
            async for _, out in outs:
                progress = tel.note(out) if tel is not None else None
                if progress is not None:
                    name, data = builder.event("response.in_progress", response=builder.response("in_progress"),
                                               prompt_progress=progress)
                    yield name, tel.stamp(data)
                events = parser.feed(output.add(out), output.last_tokens, output.finish_reason is not None)
                shown += "".join(e[1] for e in events if e[0] == "text")
                thought += "".join(e[1] for e in events if e[0] == "reasoning")
                for event in builder.streamed(events):
                    yield (event[0], tel.stamp(event[1])) if tel is not None else event
        use = usage(turn.input_tokens, turn.cached_tokens(output.cached_tokens), output.n_tokens,
                    parser.reasoning_tokens)
        events = builder.closing(output, use)
        said = {"role": "assistant", "content": shown, "reasoning_content": thought or None,
                "tool_calls": parser.calls}
        record = _record(ctx, turn, run.request_id, output, said, events[-1][1]["response"], keep, items)
        if tel is not None:
            tel.stamp(events[-1][1], final=True)
        for event in events:
            yield event
    except Exception as exc:  # any failure reaches the client as an error event
        err = as_api_error(exc)
        if err.status >= 500:
            log.exception("response stream %s failed", run.request_id)
        yield builder.event("error", code=err.code, message=err.message, param=err.param)
    finally:
        _settle_later(ctx, store, run, turn, record)


def _settle_later(ctx: ServerContext, store: ResponseStore, run: GenerationRun, turn: Turn,
                  record: Stored | None) -> None:
    """Finish a streamed turn's run and settle the turn off the stream's task: a dropped client cancels the
    stream's generator, not the clean-up (which waits for the cancelled run to end)."""
    driver.finish(ctx, run)
    task = asyncio.ensure_future(settle(ctx, store, turn, record, run))
    _pending.add(task)
    task.add_done_callback(_settled)


def _settled(task: asyncio.Task) -> None:
    _pending.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("settling a streamed turn failed", exc_info=task.exception())


_pending: set[asyncio.Task] = set()  # clean-ups of streams whose clients left (kept referenced until done)


def _record(ctx: ServerContext, turn: Turn, rid: str, output: Output, said: dict, answer: dict, keep: bool,
            items: list[dict]) -> Stored | None:
    """What is stored of a turn that ended well (stop or length), if it is to be kept: `said` is the reply
    as an assistant message (content, reasoning_content, tool_calls; empty ones left out)."""
    if not keep or turn.seq_id is None or output.finish_reason not in ("stop", "length"):
        return None
    reply = {k: v for k, v in said.items() if k == "content" or v}
    end = ctx.tokens.token_str(output.last_token) if output.ended_on_stop_token else None
    return Stored(rid, turn.seq_id, turn.input_tokens + output.n_tokens, turn.prev, turn.instructions, turn.tools,
                  turn.inputs, reply, end, answer, turn.template_kwargs, items)


async def _live(ctx: ServerContext, store: ResponseStore, response_id: str) -> Stored:
    """A stored response whose sequence still exists (else it is forgotten: 404)."""
    rec = store.get(response_id)
    try:
        await ctx.require_engine().sequence_info(rec.seq_id)
    except SequenceNotFound:
        store.forget_sequence(rec.seq_id)
        store.get(response_id)  # raises the 404
    return rec


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict:
    ctx = ServerContext.of(request)
    return (await _live(ctx, store_of(request), response_id)).body


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, order: str = "desc", after: str | None = None,
                           limit: int = Query(20)) -> dict:
    ctx = ServerContext.of(request)
    return page((await _live(ctx, store_of(request), response_id)).input_items, order, after, limit)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    ctx = ServerContext.of(request)
    ctx.require_engine()
    seq_id = store_of(request).remove(response_id)
    if seq_id is not None:
        with contextlib.suppress(EngineError):
            await ctx.engine.delete(seq_id)
    return {"id": response_id, "object": "response", "deleted": True}

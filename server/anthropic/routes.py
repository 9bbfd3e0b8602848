"""Anthropic's Messages API: `POST /v1/messages` (JSON or a stream) and `POST /v1/messages/count_tokens`.

Each request renders its conversation with the chat template (tools in the template's own tool-call
format, or in the generic JSON format when it cannot render them: `server.generation.toolcalls`) and
runs as one generation: there is no server-side state, and an earlier conversation resent is found by
the automatic prefix cache (`usage.cache_read_input_tokens`), so `cache_control` needs no work. Every limit of the chat route applies (body size, context and pool fit, queue, disconnect
cancels); errors have Anthropic's shape (`server.anthropic.errors`).
"""

import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.api.ids import new_id
from engine.api.sampling_params import SamplingParams
from server.anthropic.errors import anthropic_error
from server.anthropic.protocol import CountTokensRequest, MessagesRequest
from server.anthropic.shapes import MessageBuilder, usage
from server.errors import APIError, as_api_error
from server.generation import driver
from server.generation.lora import lora_ref
from server.generation.output import Output
from server.generation.reasoning import template_kwargs
from server.generation.reply import Reply, reply_of
from server.generation.run import GenerationRun
from server.generation.sampling import build_sampling_params
from server.generation.sse import STREAMED_200, NamedEventStream
from server.generation.toolcalls import ToolPlan, chat_template_of, prompt_args
from server.state import ServerContext

router = APIRouter()
log = logging.getLogger("cellserve.server")


async def _prompt(ctx: ServerContext, body: CountTokensRequest) -> tuple[list[int], ToolPlan]:
    mode, name, parallel = body.tool_mode()
    tools = ToolPlan([t.as_tool() for t in body.tools or ()], mode, name, parallel=parallel,
                     chat_template=chat_template_of(ctx.tokens))
    messages, template_tools = prompt_args(tools.prompting(), body.chat_messages())
    thinking = body.thinking.model_dump() if body.thinking is not None else None
    kwargs = template_kwargs(chat_template_of(ctx.tokens), None, None, thinking)
    ids = await ctx.tokens.encode_chat(messages, tools=template_tools, template_kwargs=kwargs)
    return ids, tools


def sampling(body: MessagesRequest, guided: dict | None) -> SamplingParams:
    kwargs = {"max_tokens": body.max_tokens, "lora": lora_ref(body.model)}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    if body.stop_sequences:
        kwargs["stop"] = body.stop_sequences
    return build_sampling_params(kwargs, guided, {"stop": "stop_sequences"})


@router.post("/v1/messages", responses=STREAMED_200)
async def messages(body: MessagesRequest, request: Request) -> Response:
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    prompt, tools = await _prompt(ctx, body)
    engine.check_fits([len(prompt)], body.max_tokens)
    reply = await reply_of(ctx, tools, prompt)
    run = GenerationRun(engine, new_id("msg"), [prompt], sampling(body, tools.guided()), metrics=ctx.metrics)
    gone = await driver.start(request, ctx, run)
    if gone is not None:
        return gone
    builder = MessageBuilder(run.request_id, ctx.model_name,
                             show_thinking=body.thinking is None or body.thinking.shown)
    headers = {"X-Request-Id": run.request_id, "request-id": run.request_id}
    if body.stream:
        return NamedEventStream(_stream(ctx, run, builder, reply, len(prompt)), headers=headers,
                                if_unstarted=lambda: driver.finish(ctx, run))
    output = Output()
    gone = await driver.collect(request, ctx, run, output.fold)
    if gone is not None:
        return gone
    if output.finish_reason == "error":
        raise APIError(500, f"generation failed: {output.error or 'engine error'}", code="engine_error")
    reasoning, content, calls = reply.split(output.text)
    use = usage(len(prompt), output.cached_tokens, output.n_tokens)
    return JSONResponse(builder.final(output, content, calls, use, reasoning), headers=headers)


async def _stream(ctx: ServerContext, run: GenerationRun, builder: MessageBuilder, reply: Reply,
                  prompt_tokens: int) -> AsyncIterator[tuple[str, dict]]:
    output, parser = Output(), reply.stream()
    try:
        async with driver.streamed(ctx, run) as outs:
            for event in builder.opening(usage(prompt_tokens, 0, 0)):
                yield event
            async for _, out in outs:
                events = parser.feed(output.add(out), output.last_tokens, output.finish_reason is not None)
                if output.finish_reason == "error":
                    raise APIError(500, f"generation failed: {output.error or 'engine error'}", code="engine_error")
                for event in builder.streamed(events):
                    yield event
        for event in builder.closing(output, parser.called, usage(prompt_tokens, output.cached_tokens, output.n_tokens)):
            yield event
    except Exception as exc:  # any failure reaches the client as an error event
        err = as_api_error(exc)
        if err.status >= 500:
            log.exception("message stream %s failed", run.request_id)
        yield "error", anthropic_error(err.status, err.message)
    finally:
        driver.finish(ctx, run)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    ctx = ServerContext.of(request)
    ctx.require_engine()
    prompt, _ = await _prompt(ctx, body)
    return {"input_tokens": len(prompt)}

"""OpenAI-compatible generation routes: `POST /v1/completions` and `POST /v1/chat/completions`.

Each route only translates: validate (pydantic), tokenize (worker thread), build `SamplingParams`,
start a `GenerationRun`, and let `server.openai.response.serve` answer as JSON or SSE. Defaults follow OpenAI:
completions `max_tokens` 16, chat `max_tokens` up to the context that is left.
"""

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.api.ids import new_id
from server.errors import APIError
from server.openai.chat import ChatFormatter
from server.openai.completions import Formatter
from server.openai.generation import GenerationRun
from server.openai.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    sampling_params,
)
from server.openai.response import serve
from server.openai.sse import STREAMED_200
from server.openai.tools import call_grammar, supports_tools, template_tools
from server.state import ServerContext

router = APIRouter()


@router.post("/v1/completions", responses=STREAMED_200)
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    ctx.limits.check_choices(len(body.prompt), body.n)
    prompts = [await ctx.tokens.prompt_ids(p) for p in body.prompt]
    prefixes = None
    if body.echo:
        prefixes = [p if isinstance(p, str) else await ctx.tokens.decode(p) for p in body.prompt]
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    engine.check_fits([len(p) for p in prompts], max_tokens, body.n)
    params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs,
                             prompt_logprobs=body.prompt_logprobs_k())
    run = GenerationRun(engine, new_id("cmpl"), prompts, params, metrics=ctx.metrics)
    fmt = Formatter(run, model=ctx.model_name, token_str=ctx.tokens.token_str, n=body.n,
                    want_logprobs=body.logprobs is not None, include_usage=body.include_usage(),
                    prefixes=prefixes, vllm_prompt_logprobs=body.prompt_logprobs)
    return await serve(request, ctx, run, fmt, stream=body.stream)


@router.post("/v1/chat/completions", responses=STREAMED_200)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    ctx.limits.check_choices(1, body.n)
    mode = body.tool_mode()
    tools = None
    if mode != "none":
        if supports_tools(getattr(ctx.tokens.tok, "chat_template", None)):
            tools = template_tools(body.tools)
        elif mode == "auto":
            raise APIError(400, "this model's chat template cannot render tools, so the model cannot choose to "
                           "call one; send tool_choice 'required' or a named function (decoding is then "
                           "constrained to a well-formed call), or no tools", param="tools")
    prompt = await ctx.tokens.prompt_ids(None, body.messages, tools=tools,
                                         add_generation_prompt=body.add_generation_prompt)
    max_tokens = body.max_new_tokens()
    if max_tokens is None:
        max_tokens = engine.max_tokens_left(len(prompt), body.n)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    guided = None
    if mode in ("required", "named") or (mode == "auto" and body.guided() is None):
        guided = call_grammar(body.tools, body.tool_name(), parallel=body.parallel_tool_calls,
                              triggered=mode == "auto")
    params = sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, guided=guided)
    run = GenerationRun(engine, new_id("chatcmpl"), [prompt], params, metrics=ctx.metrics)
    fmt = ChatFormatter(run, model=ctx.model_name, token_str=ctx.tokens.token_str, n=body.n,
                        want_logprobs=body.logprobs, include_usage=body.include_usage(), tools=mode != "none",
                        parallel_tool_calls=body.parallel_tool_calls)
    return await serve(request, ctx, run, fmt, stream=body.stream)

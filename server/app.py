"""The FastAPI app (`build_app`): mounts the routers behind the middleware, installs the error handlers
and ties the engine's lifecycle to the app's.

`build_app(engine, ...)` takes either a ready `EngineClient` (an `AsyncEngine`) (tests build a real one from a tiny
seeded model) or a zero-argument factory that builds one (the CLI: the model loads in a worker
thread after the socket is open, and `/health` answers 503 until it is ready). The app starts the
engine when it starts and shuts it down (finishing or cancelling in-flight work within the grace
period) when it stops. `server/` never touches tensors: it talks to the engine only through the
AsyncEngine API (generate, cancel, sequence verbs, stats, tokenizer).
"""

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Union

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

from engine.api.ids import new_id
from server.errors import ERROR_RESPONSES, APIError, install_error_handlers, without_422
from server.limits import Limits
from server.middleware import BodySizeLimit, HeadAsGet, require_api_key
from server.openai.completions import STREAMED_200, Formatter, GenerationRun, serve
from server.openai.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    sampling_params,
)
from server.openai.tools import ChatFormatter, call_grammar, supports_tools, template_tools
from server.ops import routes as ops_routes
from server.sequences import routes as sequence_routes
from server.state import EngineFactory, ServerContext

if TYPE_CHECKING:  # the server never imports the engine (torch) at run time; it is injected
    from engine.api.client import EngineClient

log = logging.getLogger("cellserve.server")


def build_app(engine: Union["EngineClient", EngineFactory], *, served_model_name: str | None = None,
              api_key: str | None = None, shutdown_grace_s: float = 30.0, on_fatal=None,
              limits: Limits | None = None) -> FastAPI:
    """The HTTP app over `engine` (an EngineClient, or a zero-argument callable that builds one).

    `on_fatal(reason)` is called if the model fails to load or the engine loop dies (the CLI exits
    non-zero). With an `api_key` the interactive docs and the OpenAPI schema are off: every route but
    `/health` and `/metrics` needs the key, and the docs cannot send it. Paths are matched exactly
    (no trailing-slash redirects, which would build a `Location` from the client's `Host`), and every
    GET route answers HEAD too (HEAD-based health checks)."""
    ctx = ServerContext(engine, served_model_name=served_model_name, api_key=api_key,
                        shutdown_grace_s=shutdown_grace_s, on_fatal=on_fatal, limits=limits)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await ctx.startup()
        try:
            yield
        finally:
            await ctx.shutdown()

    docs = {} if not api_key else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="cellserve", version="0.1.0", lifespan=lifespan, redirect_slashes=False,
                  description="Multi-sequence LLM inference over one shared pool of KV cells.", **docs)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(ops_routes.public, responses=ERROR_RESPONSES)
    guarded = [Depends(require_api_key)]
    for router in (openai_router, sequence_routes.router, ops_routes.router):
        app.include_router(router, dependencies=guarded, responses=ERROR_RESPONSES)
    _document_errors_only_as_sent(app)
    app.add_middleware(HeadAsGet)
    app.add_middleware(BodySizeLimit, limits=ctx.limits)
    return app


def _document_errors_only_as_sent(app: FastAPI) -> None:
    """The schema lists the error statuses the server sends (ERROR_RESPONSES), not FastAPI's 422."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = without_422(build())
        return app.openapi_schema

    app.openapi = openapi


# --- OpenAI-compatible generation routes: `POST /v1/completions` and `POST /v1/chat/completions`.
#
# Each route only translates: validate (pydantic), tokenize (worker thread), build `SamplingParams`,
# start a `GenerationRun`, and let `server.openai.completions` answer as JSON or SSE. Defaults follow OpenAI:
# completions `max_tokens` 16, chat `max_tokens` up to the context that is left.

openai_router = APIRouter()


@openai_router.post("/v1/completions", responses=STREAMED_200)
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
    fmt = Formatter(ctx, run, n=body.n, want_logprobs=body.logprobs is not None,
                    include_usage=body.include_usage(), prefixes=prefixes, vllm_prompt_logprobs=body.prompt_logprobs)
    return await serve(request, ctx, run, fmt, stream=body.stream)


@openai_router.post("/v1/chat/completions", responses=STREAMED_200)
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
    fmt = ChatFormatter(ctx, run, n=body.n, want_logprobs=body.logprobs, include_usage=body.include_usage(),
                        tools=mode != "none", parallel_tool_calls=body.parallel_tool_calls)
    return await serve(request, ctx, run, fmt, stream=body.stream)

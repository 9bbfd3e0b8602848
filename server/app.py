"""The FastAPI app (`build_app`): mounts the routers behind the middleware, installs the error handlers
and ties the engine's lifecycle to the app's.

`build_app(engine, ...)` takes either a ready `EngineClient` (an `AsyncEngine`) (tests build a real one from a tiny
seeded model) or a zero-argument factory that builds one (the CLI: the model loads in a worker
thread after the socket is open, and `/health` answers 503 until it is ready). The app starts the
engine when it starts and shuts it down (finishing or cancelling in-flight work within the grace
period) when it stops. `server/` never touches tensors: it talks to the engine only through the
AsyncEngine API (generate, cancel, sequence verbs, stats, tokenizer).
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Union

from fastapi import Depends, FastAPI
from starlette.middleware.cors import CORSMiddleware

from server.adapters import routes as adapter_routes
from server.anthropic import routes as anthropic_routes
from server.anthropic.errors import AnthropicErrors, require_key
from server.embeddings import routes as embedding_routes
from server.errors import ERROR_RESPONSES, install_error_handlers, without_422
from server.limits import Limits
from server.llamacpp import routes as llamacpp_routes
from server.middleware import (
    BodySizeLimit,
    FormBodyAsJson,
    HeadAsGet,
    WithoutV1,
    cors_options,
    require_api_key,
)
from server.openai import routes as openai_routes
from server.ops import routes as ops_routes
from server.responses import routes as responses_routes
from server.sequences import routes as sequence_routes
from server.state import EngineFactory, ServerContext
from server.streams import routes as stream_routes
from server.streams.kept import KeptStreams
from server.streams.middleware import ResumableStreams
from server.ui import routes as ui_routes

if TYPE_CHECKING:  # the server never imports the engine (torch) at run time; it is injected
    from engine.api.client import EngineClient


def build_app(engine: Union["EngineClient", EngineFactory], *, served_model_name: str | None = None,
              api_key: str | None = None, shutdown_grace_s: float = 30.0, on_fatal=None,
              limits: Limits | None = None, ui: bool = True, state_dir: str | None = None,
              cors_origins: list[str] | None = None, pooling: str | None = None,
              rerank_mode: str = "cosine") -> FastAPI:
    """The HTTP app over `engine` (an EngineClient, or a zero-argument callable that builds one).

    `on_fatal(reason)` is called if the model fails to load or the engine loop dies (the CLI exits
    non-zero). With an `api_key` the interactive docs and the OpenAPI schema are off: every route but
    `/health` and `/metrics` needs the key, and the docs cannot send it. Paths are matched exactly
    (no trailing-slash redirects, which would build a `Location` from the client's `Host`), and every
    GET route answers HEAD too (HEAD-based health checks). `ui`: serve the chat page at `/` (static files
    that need no key; the page asks for it on a 401). `state_dir` (`--state-dir`, the engine's own folder):
    stored responses are kept in `state_dir/responses` and come back after a restart. Every OpenAI route is
    also served without `/v1` (`server.middleware.WithoutV1`). `cors_origins` (`--cors-origins`): the origins
    whose pages may call the server (`*`: any); None or empty: same-origin only (no CORS headers at all).
    `pooling` (`--pooling`): how /v1/embeddings pools hidden states (last, mean, cls; None: last).
    `rerank_mode` (`--rerank-mode`): how /v1/rerank and /v1/score score a pair: `cosine` of the two vectors, or
    `yes-no`, a causal reranker's P(yes) (server/embeddings/yes_no.py)."""
    ctx = ServerContext(engine, served_model_name=served_model_name, api_key=api_key,
                        shutdown_grace_s=shutdown_grace_s, on_fatal=on_fatal, limits=limits, state_dir=state_dir)

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
    app.state.pooling = pooling
    app.state.rerank_mode = rerank_mode
    app.state.streams = KeptStreams()
    ctx.metrics.registry.register(adapter_routes.AdapterCollector(ctx))
    install_error_handlers(app)
    app.include_router(ops_routes.public, responses=ERROR_RESPONSES)
    if ui:
        app.include_router(ui_routes.router)
    guarded = [Depends(require_api_key)]
    for router in (openai_routes.router, sequence_routes.router, ops_routes.router, responses_routes.router,
                   llamacpp_routes.router, embedding_routes.router,
                   adapter_routes.router, stream_routes.router):
        app.include_router(router, dependencies=guarded, responses=ERROR_RESPONSES)
    app.include_router(anthropic_routes.router, dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)
    _document_errors_only_as_sent(app)
    app.add_middleware(HeadAsGet)
    app.add_middleware(FormBodyAsJson)  # `curl -d` without a Content-Type
    app.add_middleware(ResumableStreams, kept_streams=app.state.streams)  # inside the body limit: it reads bodies
    app.add_middleware(BodySizeLimit, limits=ctx.limits)
    app.add_middleware(AnthropicErrors)  # Anthropic's error shape on /v1/messages, 413 included
    app.add_middleware(WithoutV1)
    if cors_origins:  # outermost: a preflight is answered before any key check; every answer gets the headers
        app.add_middleware(CORSMiddleware, **cors_options(cors_origins))
    return app


def _document_errors_only_as_sent(app: FastAPI) -> None:
    """The schema lists the error statuses the server sends (ERROR_RESPONSES), not FastAPI's 422."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = without_422(build())
        return app.openapi_schema

    app.openapi = openapi

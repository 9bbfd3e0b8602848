"""Operational routes: health, models, cell-pool state, clearing cached prefixes, metrics,
tokenize/detokenize, cancel.

`/health` and `/metrics` need no API key (load balancers and scrapers); everything else does when
`--api-key` is set. `/health` is 200 only while the server admits work, 503 with the reason
otherwise (loading, draining, failed). `/tokenize` and `/detokenize` use vLLM's shapes, and llama.cpp's when
the body says `content`.
"""

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from engine.api.errors import RequestNotFound
from server.errors import APIError
from server.generation.lora import adapter_cards
from server.generation.sequence_view import sequence_view
from server.metrics import CONTENT_TYPE
from server.ops.protocol import DetokenizeRequest, TokenizeRequest
from server.state import ServerContext

public = APIRouter()
router = APIRouter()
STARTED = int(time.time())


@public.get("/health")
async def health(request: Request) -> Response:
    ctx = ServerContext.of(request)
    ctx.require_engine()
    return JSONResponse({"status": "ok"})


@public.get("/metrics", response_class=PlainTextResponse)  # documented as text/plain
async def metrics(request: Request) -> Response:
    return Response(ServerContext.of(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    card = {"id": ctx.model_name, "object": "model", "created": STARTED, "owned_by": "cellserve",
            "root": engine.model_name, "parent": None, "max_model_len": engine.max_model_len}
    return {"object": "list", "data": [card, *adapter_cards(ctx, STARTED)]}


@router.get("/v1/cache")
async def cache(request: Request) -> dict:
    engine = ServerContext.of(request).require_engine()
    cached = await engine.cached_prefix_cells()
    s = engine.stats()
    used = s.cells_used - cached  # cached prefixes are evicted on demand: free for any new request
    return {
        "object": "cache",
        "cells": {"total": s.n_cells, "used": used, "free": s.n_cells - used, "cached": cached},
        "prefix_cache": {"enabled": engine.prefix_caching, "cached_sequences": s.prefix_cached,
                         "cells": cached, "queried_tokens": s.prefix_queried_tokens,
                         "hit_tokens": s.prefix_hit_tokens},
        "cell_bytes": engine.cell_bytes,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "pool_bytes": engine.cell_bytes * s.n_cells,
        "read_len": s.read_len,
        "requests": {"running": s.running, "waiting": s.waiting},
        "preemptions": s.preemptions,
        "sequences": [sequence_view(i) for i in await engine.list_sequences()],
    }


@router.delete("/v1/cache/prefixes")
async def clear_prefixes(request: Request) -> dict:
    """Free every cached prefix now (they are also evicted on demand); running requests and persistent
    sequences keep their cells. Behind `--api-key` like every /v1 route."""
    freed = await ServerContext.of(request).require_engine().clear_prefix_cache()
    return {"object": "cache.prefixes.cleared", "freed_cells": freed}


@router.post("/v1/requests/{request_id}/cancel")
async def cancel_request(request_id: str, request: Request) -> dict:
    ctx = ServerContext.of(request)
    ctx.require_engine()
    try:
        await ctx.cancel_request(request_id)
    except RequestNotFound as exc:
        raise RequestNotFound(f"no in-flight request {request_id!r}; it may have finished already (ids come "
                              "from a response's `id` field or its X-Request-Id header)", param="request_id") from exc
    return {"id": request_id, "object": "request.cancelled", "cancelled": True}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    ids = await ctx.tokens.prompt_ids(body.prompt, body.messages, add_generation_prompt=body.add_generation_prompt,
                                      add_special_tokens=body.add_special_tokens, empty_ok=True)
    if body.content is not None:  # llama.cpp's shape: ids, or {id, piece} with with_pieces
        pieces = [{"id": t, "piece": ctx.tokens.token_str(t)} for t in ids] if body.with_pieces else ids
        return {"tokens": pieces}
    strs = [ctx.tokens.token_str(t) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    ctx = ServerContext.of(request)
    ctx.require_engine()
    vocab = len(ctx.tokens.tok)
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})", param="tokens")
    text = await ctx.tokens.decode(body.tokens)
    return {"prompt": text, "content": text}  # vLLM's name, llama.cpp's

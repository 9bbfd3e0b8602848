"""Stateful sequences (cellserve's own API): create, inspect, continue, fork, truncate, delete.

A sequence is a persistent token history whose KV cells stay in the pool between requests, so a
conversation continues without re-prefilling, and a fork shares its parent's cells (zero-copy).
Guarantees: unknown ids are 404, a second generate on a busy sequence is 409 (both raised by the
engine and mapped by `server.errors`); a continuation's output stays in the sequence; forking a
busy sequence snapshots what it has generated so far (the engine does it at a tick boundary).
Every engine verb is a command the engine applies at its next step boundary; routes await it.
"""


import asyncio
import contextlib

from fastapi import APIRouter, Body, Request
from fastapi.responses import Response

from engine.api.errors import EngineError
from engine.api.ids import new_id
from server.generation.driver import ClientGone, await_or_disconnect
from server.generation.formatter import Formatter
from server.generation.lora import lora_ref
from server.generation.run import GenerationRun
from server.generation.sampling import COMPLETION_DEFAULT_MAX_TOKENS, sampling_params, token_rules
from server.generation.sequence_view import sequence_view
from server.generation.serve import serve
from server.generation.sse import STREAMED_200
from server.sequences.protocol import (
    ForkRequest,
    SequenceCompletionRequest,
    SequenceCreateRequest,
    TruncateRequest,
)
from server.state import ServerContext

router = APIRouter()
ARCHIVE_TYPE = "application/octet-stream"


@router.post("/v1/sequences", response_model=None)
async def create_sequence(body: SequenceCreateRequest, request: Request) -> Response | dict:
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    ids = await ctx.tokens.prompt_ids(body.prompt, body.messages, add_generation_prompt=body.add_generation_prompt,
                                      empty_ok=True)
    if not ids:
        ids = await ctx.tokens.encode("")  # BOS, or a 400 saying the model has none
    work = asyncio.ensure_future(engine.create_sequence(ids, lora_ref(body.model)))  # `model` an adapter: its own
    try:  # a create whose client is gone is rolled back (no sequence under an id nobody received)
        info = await await_or_disconnect(request, work, lambda: None)
    except ClientGone:
        await _delete_if_made(engine, work)
        return Response(status_code=499)
    return sequence_view(info)


@router.get("/v1/sequences")
async def list_sequences(request: Request) -> dict:
    engine = ServerContext.of(request).require_engine()
    return {"object": "list", "data": [sequence_view(i) for i in await engine.list_sequences()]}


@router.get("/v1/sequences/{seq_id}")
async def get_sequence(seq_id: str, request: Request) -> dict:
    ctx = ServerContext.of(request)
    info = await ctx.require_engine().sequence_info(seq_id)
    text = await ctx.tokens.decode(info.token_ids)
    return sequence_view(info, text=text, with_tokens=True)


@router.post("/v1/sequences/{seq_id}/completions", responses=STREAMED_200)
async def sequence_completions(seq_id: str, body: SequenceCompletionRequest, request: Request) -> Response:
    """Append the optional prompt/messages (no BOS: this continues a history), then generate into it."""
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    ids = await ctx.tokens.prompt_ids(body.prompt, body.messages, add_generation_prompt=body.add_generation_prompt,
                                      add_special_tokens=False, empty_ok=True)
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, **await token_rules(ctx, body))
    run = GenerationRun(engine, new_id("seqcmpl"), [ids], params, seq_id=seq_id, metrics=ctx.metrics)
    fmt = Formatter(run, model=ctx.model_name, token_str=ctx.tokens.token_str, n=1,
                    want_logprobs=body.logprobs is not None, include_usage=body.include_usage(),
                    extra={"sequence_id": seq_id}, include_stop_str=body.include_stop_str_in_output)
    return await serve(request, ctx, run, fmt, stream=body.stream)


OPTIONAL_FORK_BODY = Body(None)


@router.post("/v1/sequences/{seq_id}/fork", response_model=None)
async def fork_sequence(seq_id: str, request: Request,
                        body: ForkRequest | None = OPTIONAL_FORK_BODY) -> Response | dict:
    engine = ServerContext.of(request).require_engine()
    at = body.at if body is not None else None
    lora = lora_ref(body.model) if body is not None else None
    work = asyncio.ensure_future(engine.fork(seq_id, at, lora))
    try:  # a fork whose client is gone is rolled back
        info = await await_or_disconnect(request, work, lambda: None)
    except ClientGone:
        await _delete_if_made(engine, work)
        return Response(status_code=499)
    return sequence_view(info)


async def _delete_if_made(engine, work: asyncio.Future) -> None:
    """The client left after `work` made a sequence (it finished as the disconnect arrived; an earlier
    cancel is undone by the engine itself): delete it."""
    if work.done() and not work.cancelled() and work.exception() is None:
        with contextlib.suppress(EngineError):
            await engine.delete(work.result().seq_id)


@router.post("/v1/sequences/{seq_id}/truncate")
async def truncate_sequence(seq_id: str, body: TruncateRequest, request: Request) -> dict:
    engine = ServerContext.of(request).require_engine()
    return sequence_view(await engine.truncate(seq_id, body.length))


@router.post("/v1/sequences/{seq_id}/save")
async def save_sequence(seq_id: str, request: Request) -> dict:
    """Write the sequence and its cells to --state-dir now (507 if the disk refuses; nothing is lost)."""
    engine = ServerContext.of(request).require_engine()
    return {**sequence_view(await engine.save_sequence(seq_id)), "saved": True}


@router.get("/v1/sequences/{seq_id}/export", response_class=Response,
            responses={200: {"content": {ARCHIVE_TYPE: {}}, "description": "a safetensors archive"}})
async def export_sequence(seq_id: str, request: Request, family: bool = False) -> Response:
    """A portable archive of the sequence (with ?family=true: its whole fork family) for POST /v1/sequences/import."""
    engine = ServerContext.of(request).require_engine()
    blob = await engine.export_sequences(seq_id, family)
    name = f"{seq_id}{'-family' if family else ''}.safetensors"
    return Response(blob, media_type=ARCHIVE_TYPE, headers={"Content-Disposition": f'attachment; filename="{name}"'})


@router.post("/v1/sequences/import")
async def import_sequences(request: Request, new_ids: bool = False) -> dict:
    """The archive in the body becomes sequences here (same model only, else 409): each keeps its id when it
    is free here, else (or always, with ?new_ids=true) gets a new one (forks follow their parent's); answers
    the sequences, oldest first, and `ids`: {archive id: id here}."""
    engine = ServerContext.of(request).require_engine()
    blob = await request.body()
    infos = await engine.import_sequences(blob, new_ids)
    return {"object": "list", "data": [sequence_view(i) for i in infos.values()],
            "ids": {old: info.seq_id for old, info in infos.items()}}


@router.delete("/v1/sequences/{seq_id}")
async def delete_sequence(seq_id: str, request: Request) -> dict:
    engine = ServerContext.of(request).require_engine()
    await engine.delete(seq_id)
    return {"id": seq_id, "object": "sequence.deleted", "deleted": True}

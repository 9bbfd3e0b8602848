"""llama.cpp's native routes on cellserve's engine: `POST /completion`, `POST /infill`, `POST /apply-template`,
`GET /props`, `GET /slots`, `POST /slots/{id}?action=save|restore|erase` (`/tokenize` and `/detokenize`
take llama.cpp's fields too: server/ops).

Each route translates only: llama.cpp's fields to `SamplingParams` (server.llamacpp.protocol), a run of the
engine (the same `GenerationRun` the OpenAI routes use), llama.cpp's answer shape (server.llamacpp.answer).
Errors keep cellserve's OpenAI shape (`{"error": {...}}`, 400 for bad input), as llama-server's own do.
"""

import asyncio

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from engine.api.ids import new_id
from server.errors import APIError, as_api_error
from server.generation.driver import ClientGone, await_or_disconnect
from server.generation.formatter import SYSTEM_FINGERPRINT
from server.generation.run import GenerationRun
from server.generation.sampling import build_sampling_params
from server.generation.sse import STREAMED_200, SSEResponse
from server.generation.telemetry import Telemetry
from server.llamacpp.answer import Answer
from server.llamacpp.fim import fim_tokens, infill_ids
from server.llamacpp.protocol import (
    ApplyTemplateRequest,
    InfillRequest,
    NativeCompletionRequest,
    NativeSampling,
    SlotFile,
)
from server.llamacpp.slots import SLOTS, Slots
from server.state import ServerContext

router = APIRouter()
BUILD = SYSTEM_FINGERPRINT  # /props build_info: the build OpenAI responses name in system_fingerprint


@router.post("/completion", responses=STREAMED_200)
async def completion(body: NativeCompletionRequest, request: Request) -> Response:
    ctx = ServerContext.of(request)
    ctx.require_engine()
    prompt = await _prompt_ids(ctx, body.prompt)
    text = body.prompt if isinstance(body.prompt, str) else await ctx.tokens.decode(prompt)
    return await _generate(request, ctx, body, prompt, text)


@router.post("/infill", responses=STREAMED_200)
async def infill(body: InfillRequest, request: Request) -> Response:
    ctx = ServerContext.of(request)
    ctx.require_engine()
    fim = fim_tokens(ctx.tokens.tok)
    if fim is None:
        raise APIError(400, "this model has no fill-in-the-middle tokens (its tokenizer has none of <fim_prefix>/"
                       "<fim_suffix>/<fim_middle>, <|fim_prefix|>..., <PRE>/<SUF>/<MID>); /infill needs a code "
                       "model trained for it (StarCoder, Qwen2.5-Coder, CodeLlama, DeepSeek-Coder)",
                       param="input_prefix")
    ctx.tokens.check_length([body.input_prefix, body.input_suffix, body.prompt,
                             *(c.get("text", "") for c in body.input_extra)], "input_prefix")

    def encode(t: str) -> list[int]:
        return list(ctx.tokens.tok.encode(t, add_special_tokens=False)) if t else []

    prompt = await asyncio.to_thread(infill_ids, fim, encode, body.input_prefix, body.input_suffix,
                                     body.prompt, body.input_extra)
    return await _generate(request, ctx, body, prompt, await ctx.tokens.decode(prompt))


async def _prompt_ids(ctx: ServerContext, prompt: str | list) -> list[int]:
    """llama.cpp's prompt forms: text, token ids, or a list mixing both (texts tokenized without BOS)."""
    if isinstance(prompt, str):
        return await ctx.tokens.encode(prompt)
    ids: list[int] = []
    for part in prompt:
        ids += await ctx.tokens.encode(part, add_special_tokens=False) if isinstance(part, str) else [part]
    vocab = len(ctx.tokens.tok)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})", param="prompt")
    return ids


async def _generate(request: Request, ctx: ServerContext, body: NativeSampling, prompt: list[int],
                    prompt_text: str) -> Response:
    engine = ctx.engine
    if body.id_slot >= 0:
        Slots.check(body.id_slot)
    max_tokens = body.max_tokens if body.max_tokens is not None else body.n_predict
    if max_tokens < 0:
        max_tokens = engine.max_tokens_left(len(prompt))
    engine.check_fits([len(prompt)], max_tokens)
    params = build_sampling_params({"max_tokens": max_tokens, "report_progress": body.wants_progress(),
                                    **body.engine_fields(ctx.tokens.eos_ids())}, None)
    seq_id, ids, kept = None, prompt, 0
    if body.id_slot >= 0:
        seq_id, ids, kept = await _slots(request).prepare(engine, body.id_slot, prompt, body.cache_prompt)
    answer = Answer(model=ctx.model_name, prompt_text=prompt_text, prompt_len=len(prompt), id_slot=body.id_slot,
                    n_probs=body.n_probs, return_tokens=body.return_tokens, settings=_settings(ctx, body, max_tokens),
                    telemetry=Telemetry(len(prompt), per_token=body.timings_per_token, kept=kept))
    run = GenerationRun(engine, new_id("cmpl"), [ids], params, seq_id=seq_id, metrics=ctx.metrics)
    try:
        await await_or_disconnect(request, run.start(), run.close)
    except ClientGone:
        return Response(status_code=499)
    ctx.register(run)
    headers = {"X-Request-Id": run.request_id}
    if body.stream:
        return SSEResponse(_stream(ctx, run, answer), headers=headers)
    try:
        await await_or_disconnect(request, _collect(ctx, run, answer), run.close)
    except ClientGone:
        return Response(status_code=499)
    finally:
        run.close()
        ctx.unregister(run)
    if answer.finish_reason == "error":
        raise APIError(500, f"generation failed: {answer.error or 'engine error'}", code="engine_error")
    return JSONResponse(answer.final(), headers=headers)


async def _collect(ctx: ServerContext, run: GenerationRun, answer: Answer) -> None:
    async for _, out in run.events():
        answer.note(out, ctx.tokens.token_str)


async def _stream(ctx: ServerContext, run: GenerationRun, answer: Answer):
    """llama-server's native stream: a chunk per step, then the final object (`stop: true`); no [DONE]."""
    try:
        async for _, out in run.events():
            chunks = answer.note(out, ctx.tokens.token_str)
            if answer.finish_reason == "error":
                yield APIError(500, f"generation failed: {answer.error}", code="engine_error").body()
                return
            for chunk in chunks:
                yield chunk
        yield answer.final(streamed=True)
    except Exception as exc:  # noqa: BLE001 -- any failure reaches the client as an error event
        yield as_api_error(exc).body()
    finally:
        run.close()
        ctx.unregister(run)


def _settings(ctx: ServerContext, body: NativeSampling, max_tokens: int) -> dict:
    return {"n_ctx": ctx.engine.max_model_len, "n_predict": max_tokens, "model": ctx.model_name,
            "temperature": body.temperature, "top_k": body.top_k, "top_p": body.top_p, "min_p": body.min_p,
            "seed": body.seed, "stop": list(body.stop), "n_probs": body.n_probs, "repeat_penalty": body.repeat_penalty,
            "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
            "ignore_eos": body.ignore_eos, "logit_bias": body.settings_bias(ctx.tokens.eos_ids()),
            "stream": body.stream, "cache_prompt": body.cache_prompt,
            "timings_per_token": body.timings_per_token, "return_progress": body.return_progress}


@router.post("/apply-template")
async def apply_template(body: ApplyTemplateRequest, request: Request) -> dict:
    """The chat template applied to `messages`, as text (llama.cpp's `{"prompt": ...}`)."""
    ctx = ServerContext.of(request)
    ctx.require_engine()
    ids = await ctx.tokens.encode_chat(body.messages, add_generation_prompt=body.add_generation_prompt)
    return {"prompt": await ctx.tokens.decode(ids)}


@router.get("/props")
async def props(request: Request) -> dict:
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    tok = ctx.tokens.tok
    defaults = NativeSampling()
    return {"default_generation_settings": {"id": 0, "n_ctx": engine.max_model_len, "is_processing": False,
                                            "params": _settings(ctx, defaults, -1)},
            "total_slots": SLOTS, "model_path": engine.model_name, "model_alias": ctx.model_name,
            "n_ctx": engine.max_model_len, "chat_template": getattr(tok, "chat_template", None) or "",
            "bos_token": getattr(tok, "bos_token", None) or "", "eos_token": getattr(tok, "eos_token", None) or "",
            "infill": fim_tokens(tok) is not None, "modalities": {"vision": False, "audio": False},
            "build_info": BUILD}


@router.get("/slots")
async def list_slots(request: Request) -> list[dict]:
    """Every slot id, with what its sequence holds (llama.cpp lists all -np slots)."""
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    slots = _slots(request)
    out = []
    for k in range(SLOTS):
        info = await slots.info(engine, k)
        out.append({"id": k, "id_task": -1, "n_ctx": engine.max_model_len,
                    "is_processing": info is not None and info.status != "idle",
                    "n_past": info.length if info is not None else 0,
                    "cache_tokens": info.n_cached if info is not None else 0,
                    "sequence_id": info.seq_id if info is not None else None})
    return out


@router.post("/slots/{id_slot}")
async def slot_action(id_slot: int, request: Request, action: str = Query(...),
                      body: SlotFile | None = None) -> dict:
    ctx = ServerContext.of(request)
    engine = ctx.require_engine()
    Slots.check(id_slot)
    slots = _slots(request)
    if action == "erase":
        return await slots.erase(engine, id_slot)
    if action not in ("save", "restore"):
        raise APIError(400, f"unknown slot action {action!r}: save, restore or erase", param="action")
    if body is None:
        raise APIError(400, f"action {action} needs a body {{\"filename\": \"NAME\"}}", param="filename")
    return await (slots.save if action == "save" else slots.restore)(engine, id_slot, body.filename)


def _slots(request: Request) -> Slots:
    state = request.app.state
    if getattr(state, "llamacpp_slots", None) is None:
        state.llamacpp_slots = Slots(ServerContext.of(request).state_dir)
    return state.llamacpp_slots

"""One generation from validated request to HTTP answer: the engine requests it runs as
(`GenerationRun`), the OpenAI completion shapes it is answered in, the SSE framing of a stream, and
`serve`, which turns a started run into one JSON body or an event stream. Chat's shapes and tool
calls build on this in `server.openai.tools`.

Guarantees of `serve`:
- Non-streaming: the route waits for every choice while watching for the client to leave; if it
  leaves, the engine requests are cancelled (cells freed at the next tick) and nothing is sent.
- Streaming: chunks in OpenAI's shapes, `data: [DONE]` last; an engine failure mid-stream becomes a
  `data: {"error": {...}}` event followed by `[DONE]`; a dropped client cancels the engine requests.
- Both: the run is registered under its request id for `POST /v1/requests/{id}/cancel` while it
  lives and unregistered after; the `X-Request-Id` header carries the id.
"""

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.api.outputs import CompletionOutput, RequestOutput, TokenLogprob
from server.errors import APIError, as_api_error, error_body
from server.metrics import RequestObserver, ServerMetrics
from server.state import ServerContext

if TYPE_CHECKING:  # types only: the server does not import the engine (torch) at run time
    from engine.api.client import EngineClient
    from engine.api.sampling_params import SamplingParams

log = logging.getLogger("cellserve.server")


# --- One HTTP generation as engine requests: start, merge their outputs, cancel what is left.
#
# A completion with several prompts becomes one engine request per prompt (ids `<id>-0`, `<id>-1`,
# ...; a single prompt keeps `<id>` itself); `n` choices per prompt are the engine's business (it
# prefills once and forks). `GenerationRun` guarantees:
# - `start()` either admits every engine request or raises the engine's typed error (QueueFull,
#   PromptTooLong, SequenceBusy, ...) after cancelling the ones it had submitted, so a refused HTTP
#   request leaves nothing behind.
# - `events()` yields `(prompt_index, RequestOutput)` in arrival order, per-request order preserved.
# - `cancel()` cancels only requests that have not finished (the consumer still reads their final
#   `cancelled` output); `close()` is what every route calls in a `finally`: it cancels what is left
#   and counts it, so a dropped client or an exception frees the request's cells at the next tick.

_END = object()


class ClientGone(Exception):
    """The HTTP client disconnected while we were waiting on the engine."""


class GenerationRun:
    def __init__(self, engine: "EngineClient", request_id: str, prompts: list[list[int]], params: "SamplingParams", *,
                 seq_id: str | None = None, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.seq_id = seq_id
        self.engine_ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{k}" for k in range(len(prompts))]
        self._metrics = metrics
        self._observers = [RequestObserver(metrics) for _ in prompts]
        self._closed = False
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._attempted = 0
        self._finished: set[int] = set()

    async def start(self) -> None:
        """Submit every engine request; on any refusal (or our own cancellation) cancel the others."""
        try:
            for rid, ids in zip(self.engine_ids, self.prompts):
                self._attempted += 1  # counted before the await: a cancelled submit may still land
                self._streams.append(await self.engine.submit(rid, ids, self.params, seq_id=self.seq_id))
        except BaseException:
            self.cancel()
            raise

    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self._streams) == 1:
            async for out in self._one(0):
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k: int) -> None:
            try:
                async for out in self._one(k):
                    await queue.put((k, out))
            except Exception as exc:  # noqa: BLE001 -- re-raised on the consumer side, in order
                await queue.put((k, exc))
            finally:
                await queue.put((k, _END))

        tasks = [asyncio.create_task(pump(k)) for k in range(len(self._streams))]
        try:
            live = len(tasks)
            while live:
                k, item = await queue.get()
                if item is _END:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield k, item
        finally:
            for t in tasks:
                t.cancel()

    async def _one(self, k: int) -> AsyncIterator[RequestOutput]:
        observer = self._observers[k]
        async for out in self._streams[k]:
            observer.observe(out)
            if out.finished:
                self._finished.add(k)
            yield out
        self._finished.add(k)

    def close(self) -> None:
        """The consumer is done with this run: cancel what is unfinished and count it as cancelled
        (nobody will read the engine's final `cancelled` output of an abandoned request)."""
        if self._closed:
            return
        self._closed = True
        for k in range(self._attempted):
            if k not in self._finished:
                self._observers[k].abandon(self.params.n)
        self.cancel()

    def cancel(self) -> None:
        """Cancel (at the engine's next tick) every submitted engine request that has not finished.

        Queued after the submits, so it lands after them even if a submit was still in flight."""
        for k in range(self._attempted):
            if k not in self._finished:
                self.engine.cancel_nowait(self.engine_ids[k])


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


# --- Server-sent events: exact `data: {json}\n\n` framing and cancel-on-disconnect.
#
# `SSEResponse` streams an async iterator of already-built payloads (dicts become one JSON event,
# the literal `DONE` becomes `data: [DONE]`). It always races the stream against the client's
# `http.disconnect`, even under ASGI 2.4 servers where Starlette's `StreamingResponse` would only
# notice a dropped client at its next write: a request still waiting in the queue (nothing to write
# yet) must be cancelled as soon as its client leaves. When the client goes, the body iterator is
# cancelled and closed, so its `finally` runs and cancels the engine request (cells freed next tick).
# JSON encoding happens here, on the asyncio thread, never on the engine's loop thread.

DONE = object()  # sentinel payload: the terminating `data: [DONE]` event
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
# OpenAPI: a generation route answers 200 as JSON, or as an SSE stream when the body says `stream: true`.
STREAMED_200 = {200: {"description": "the response; with `stream: true` a server-sent event stream",
                      "content": {"text/event-stream": {"schema": {}}}}}


def encode_event(payload: Any) -> bytes:
    """One SSE event: `data: <json>\\n\\n` (or `data: [DONE]\\n\\n`). JSON keeps non-ASCII as is."""
    if payload is DONE:
        return b"data: [DONE]\n\n"
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _encoded(payloads: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    async for payload in payloads:
        yield encode_event(payload)


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response whose producer is cancelled the moment the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, payloads: AsyncIterator[Any], *, headers: dict[str, str] | None = None):
        self._payloads = payloads
        super().__init__(_encoded(payloads), headers={**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away between our disconnect check and a write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await wait_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._close_producer()

    async def _close_producer(self) -> None:
        for it in (self.body_iterator, self._payloads):
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()


# --- OpenAI response and stream-chunk shapes, built as plain dicts from per-choice state.
#
# Guarantees: the field names, nesting and `object` values match OpenAI's `text_completion`,
# `chat.completion` and `chat.completion.chunk` objects, so the `openai` SDK parses them unchanged;
# `usage` counts the prompt once per prompt (not once per choice); logprobs follow the legacy
# completions shape (`tokens`/`token_logprobs`/`top_logprobs`/`text_offset`) or the chat shape
# (`content: [{token, logprob, bytes, top_logprobs}]`). Nothing here touches the engine or tokenizes
# text; token strings come from the injected `token_str` callable.

TokenStr = Callable[[int], str]


@dataclass
class ChoiceState:
    """Everything one choice has produced so far (text and tokens accumulate; deltas are separate)."""

    index: int
    prompt_index: int
    prefix: str = ""  # echoed prompt text (completions with echo=true)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    lp_chars: int = 0  # characters of token strings already streamed (text_offset of the next token)


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: prompt tokens whose cells came from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(lps: list[TokenLogprob], token_str: TokenStr, offset: int) -> dict:
    """Legacy completions logprobs; `offset` is the text offset of the first token in the choice."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        s = token_str(lp.token_id)
        tokens.append(s)
        values.append(lp.logprob)
        top = {token_str(t): v for t, v in lp.top}
        top.setdefault(s, lp.logprob)  # OpenAI always includes the sampled token
        tops.append(top)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(plp, token_str: TokenStr) -> dict:
    """Legacy completions logprobs of the echoed prompt (an `engine.api.outputs.PromptLogprobs`): the first
    token's logprob and top_logprobs are null, as OpenAI and vLLM answer."""
    tokens = [token_str(t) for t in plp.token_ids]
    tops, offsets, offset = [], [], 0
    for s, lp, top in zip(tokens, plp.logprobs, plp.top):
        if top is None:
            tops.append(None)
        else:
            d = {token_str(t): v for t, v in top}
            d.setdefault(s, lp)
            tops.append(d)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": list(plp.logprobs), "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(plp, token_str: TokenStr, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id (as a string):
    {logprob, rank, decoded_token}} holding the prompt token and the k most likely ones."""
    out: list[dict | None] = []
    for tok, lp, rank, top in zip(plp.token_ids, plp.logprobs, plp.ranks, plp.top):
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": v, "rank": r, "decoded_token": token_str(t)}
                 for r, (t, v) in enumerate(top[:k], start=1)}
        entry.setdefault(str(tok), {"logprob": lp, "rank": rank, "decoded_token": token_str(tok)})
        out.append(entry)
    return out


def join_logprobs(first: dict | None, then: dict) -> dict:
    if first is None:
        return then
    return {k: first[k] + then[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def completion_response(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": use, "system_fingerprint": None}


def completion_choice(c: ChoiceState, token_str: TokenStr, want_logprobs: bool, prompt_lp: dict | None = None) -> dict:
    """`prompt_lp`: the echoed prompt's logprobs (`prompt_logprobs`), put before the generated ones."""
    lp = join_logprobs(prompt_lp, completion_logprobs(c.logprobs, token_str, len(c.prefix))) if want_logprobs else None
    return {"index": c.index, "text": c.prefix + c.text, "logprobs": lp, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}


def chunk(obj: str, rid: str, created: int, model: str, choices: list[dict], with_usage: bool) -> dict:
    """One stream chunk; `usage: null` is present on every chunk iff include_usage was asked for."""
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
           "system_fingerprint": None}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(obj: str, rid: str, created: int, model: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use,
            "system_fingerprint": None}


class Formatter:
    """How one endpoint shapes choices and chunks (completions vs chat)."""

    chunk_object = "text_completion"

    def __init__(self, ctx: ServerContext, run: GenerationRun, *, n: int, want_logprobs: bool,
                 include_usage: bool = False, prefixes: list[str] | None = None, extra: dict | None = None,
                 vllm_prompt_logprobs: int | None = None):
        """`vllm_prompt_logprobs`: add vLLM's per-choice `prompt_logprobs` (k alternatives per token)."""
        self.ctx, self.run = ctx, run
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.created = now()
        self.extra = extra or {}
        self.echo = prefixes is not None
        self.cached: dict[int, int] = {}  # prompt index -> its cached prompt tokens
        self.prompt_lps: dict[int, dict] = {}  # prompt index -> its echoed prompt's logprobs
        self.vllm_k = vllm_prompt_logprobs
        self.vllm_lps: dict[int, list] = {}  # prompt index -> vLLM-shaped prompt_logprobs
        self.states = {
            (k, i): ChoiceState(index=k * n + i, prompt_index=k, prefix=(prefixes or [""] * len(run.prompts))[k])
            for k in range(len(run.prompts)) for i in range(n)
        }

    def apply(self, k: int, co: CompletionOutput) -> ChoiceState:
        st = self.states[(k, co.index)]
        st.text += co.text
        st.token_ids += co.token_ids
        if co.logprobs:
            st.logprobs += co.logprobs
        if co.finish_reason:
            st.finish_reason, st.stop_reason, st.error = co.finish_reason, co.stop_reason, co.error
        return st

    def total_usage(self) -> dict:
        return usage(self.run.prompt_tokens(), sum(len(s.token_ids) for s in self.states.values()),
                     sum(self.cached.values()))

    def note(self, k: int, out: RequestOutput) -> None:
        """Per-request facts carried by every output (prompt tokens served from the prefix cache)."""
        self.cached[k] = out.cached_tokens
        plp = out.prompt_logprobs
        if plp is not None:  # once per prompt
            if self.want_logprobs and self.echo:
                self.prompt_lps[k] = prompt_logprobs(plp, self.ctx.tokens.token_str)
            if self.vllm_k is not None:
                self.vllm_lps[k] = vllm_prompt_logprobs(plp, self.ctx.tokens.token_str, self.vllm_k)

    def ordered(self) -> list[ChoiceState]:
        return sorted(self.states.values(), key=lambda s: s.index)

    # completions shapes (ChatFormatter overrides)
    def final(self) -> dict:
        choices = [completion_choice(s, self.ctx.tokens.token_str, self.want_logprobs,
                                     self.prompt_lps.get(s.prompt_index)) for s in self.ordered()]
        if self.vllm_k is not None:
            for choice, s in zip(choices, self.ordered()):
                choice["prompt_logprobs"] = self.vllm_lps.get(s.prompt_index)
        body = completion_response(self.run.request_id, self.created, self.ctx.model_name, choices,
                                   self.total_usage())
        return {**body, **self.extra}

    def opening_chunks(self) -> list[dict]:
        return []

    def delta_chunk(self, st: ChoiceState, co: CompletionOutput, first: bool) -> dict:
        lp = None
        if self.want_logprobs:
            lp = completion_logprobs(co.logprobs or [], self.ctx.tokens.token_str, len(st.prefix) + st.lp_chars)
            st.lp_chars += sum(len(t) for t in lp["tokens"])
            if first:
                lp = join_logprobs(self.prompt_lps.get(st.prompt_index), lp)
        text = (st.prefix if first else "") + co.text
        choice = {"index": st.index, "text": text, "logprobs": lp, "finish_reason": co.finish_reason,
                  "stop_reason": co.stop_reason}
        if first and self.vllm_k is not None:
            choice["prompt_logprobs"] = self.vllm_lps.get(st.prompt_index)
        return self._chunk([choice])

    def _chunk(self, choices: list[dict]) -> dict:
        out = chunk(self.chunk_object, self.run.request_id, self.created, self.ctx.model_name, choices,
                    self.include_usage)
        return {**out, **self.extra}


async def serve(request: Request, ctx: ServerContext, run: GenerationRun, fmt: Formatter, *,
                stream: bool) -> Response:
    """Start the run (typed engine errors become 4xx/5xx here) and answer in the asked-for mode."""
    try:
        await await_or_disconnect(request, run.start(), run.close)
    except ClientGone:
        return Response(status_code=499)
    headers = {"X-Request-Id": run.request_id}
    ctx.register(run)
    if stream:
        return SSEResponse(_stream(ctx, run, fmt), headers=headers)
    try:
        await await_or_disconnect(request, _collect(run, fmt), run.close)
    except ClientGone:
        return Response(status_code=499)
    finally:
        run.close()
        ctx.unregister(run)
    failed = [s for s in fmt.states.values() if s.finish_reason == "error"]
    if failed:
        raise APIError(500, f"generation failed: {failed[0].error or 'engine error'}", code="engine_error")
    return JSONResponse(fmt.final(), headers=headers)


async def _collect(run: GenerationRun, fmt: Formatter) -> None:
    async for k, out in run.events():
        fmt.note(k, out)
        for co in out.outputs:
            fmt.apply(k, co)


async def _stream(ctx: ServerContext, run: GenerationRun, fmt: Formatter) -> AsyncIterator:
    try:
        for c in fmt.opening_chunks():
            yield c
        started: set[tuple[int, int]] = set()
        async for k, out in run.events():
            fmt.note(k, out)
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
                        yield delta
        if fmt.include_usage:
            use = fmt.total_usage()
            yield usage_chunk(fmt.chunk_object, run.request_id, fmt.created, ctx.model_name, use)
    except Exception as exc:  # any failure must reach the client as an error event
        err = as_api_error(exc)
        if err.status >= 500:
            log.exception("stream %s failed", run.request_id)
        yield err.body()
    finally:
        run.close()
        ctx.unregister(run)
    yield DONE

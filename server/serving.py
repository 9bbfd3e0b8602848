"""Turns a started `GenerationRun` into an HTTP response: one JSON body, or an SSE stream.

Guarantees:
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

from engine.outputs import CompletionOutput, RequestOutput
from server import responses as R
from server.context import ServerContext
from server.errors import APIError, as_api_error, error_body
from server.generation import ClientGone, GenerationRun, await_or_disconnect
from server.sse import DONE, SSEResponse
from server.tools import ToolCallStream, parse_tool_calls

log = logging.getLogger("cellserve.server")


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
        self.created = R.now()
        self.extra = extra or {}
        self.echo = prefixes is not None
        self.cached: dict[int, int] = {}  # prompt index -> its cached prompt tokens
        self.prompt_lps: dict[int, dict] = {}  # prompt index -> its echoed prompt's logprobs
        self.vllm_k = vllm_prompt_logprobs
        self.vllm_lps: dict[int, list] = {}  # prompt index -> vLLM-shaped prompt_logprobs
        self.states = {
            (k, i): R.ChoiceState(index=k * n + i, prompt_index=k, prefix=(prefixes or [""] * len(run.prompts))[k])
            for k in range(len(run.prompts)) for i in range(n)
        }

    def apply(self, k: int, co: CompletionOutput) -> R.ChoiceState:
        st = self.states[(k, co.index)]
        st.text += co.text
        st.token_ids += co.token_ids
        if co.logprobs:
            st.logprobs += co.logprobs
        if co.finish_reason:
            st.finish_reason, st.stop_reason, st.error = co.finish_reason, co.stop_reason, co.error
        return st

    def usage(self) -> dict:
        return R.usage(self.run.prompt_tokens(), sum(len(s.token_ids) for s in self.states.values()),
                       sum(self.cached.values()))

    def note(self, k: int, out: RequestOutput) -> None:
        """Per-request facts carried by every output (prompt tokens served from the prefix cache)."""
        self.cached[k] = out.cached_tokens
        plp = out.prompt_logprobs
        if plp is not None:  # once per prompt
            if self.want_logprobs and self.echo:
                self.prompt_lps[k] = R.prompt_logprobs(plp, self.ctx.tokens.token_str)
            if self.vllm_k is not None:
                self.vllm_lps[k] = R.vllm_prompt_logprobs(plp, self.ctx.tokens.token_str, self.vllm_k)

    def ordered(self) -> list[R.ChoiceState]:
        return sorted(self.states.values(), key=lambda s: s.index)

    # completions shapes (ChatFormatter overrides)
    def final(self) -> dict:
        choices = [R.completion_choice(s, self.ctx.tokens.token_str, self.want_logprobs,
                                       self.prompt_lps.get(s.prompt_index)) for s in self.ordered()]
        if self.vllm_k is not None:
            for choice, s in zip(choices, self.ordered()):
                choice["prompt_logprobs"] = self.vllm_lps.get(s.prompt_index)
        body = R.completion_response(self.run.request_id, self.created, self.ctx.model_name, choices, self.usage())
        return {**body, **self.extra}

    def opening_chunks(self) -> list[dict]:
        return []

    def delta_chunk(self, st: R.ChoiceState, co: CompletionOutput, first: bool) -> dict:
        lp = None
        if self.want_logprobs:
            lp = R.completion_logprobs(co.logprobs or [], self.ctx.tokens.token_str, len(st.prefix) + st.lp_chars)
            st.lp_chars += sum(len(t) for t in lp["tokens"])
            if first:
                lp = R.join_logprobs(self.prompt_lps.get(st.prompt_index), lp)
        text = (st.prefix if first else "") + co.text
        choice = {"index": st.index, "text": text, "logprobs": lp, "finish_reason": co.finish_reason,
                  "stop_reason": co.stop_reason}
        if first and self.vllm_k is not None:
            choice["prompt_logprobs"] = self.vllm_lps.get(st.prompt_index)
        return self._chunk([choice])

    def _chunk(self, choices: list[dict]) -> dict:
        out = R.chunk(self.chunk_object, self.run.request_id, self.created, self.ctx.model_name, choices,
                      self.include_usage)
        return {**out, **self.extra}


class ChatFormatter(Formatter):
    """Chat shapes. With `tools` (tools offered, tool_choice not none) the text is split into content
    and `tool_calls` (server.tools), whole or streamed, and a choice that stopped after calling tools
    ends with finish_reason `tool_calls`."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, tools: bool = False, parallel_tool_calls: bool = True, **kw):
        super().__init__(*args, **kw)
        self.tools, self.parallel = tools, parallel_tool_calls
        self.tool_streams = {st.index: ToolCallStream(parallel_tool_calls) for st in self.states.values()} if tools else {}

    def final(self) -> dict:
        choices = []
        for s in self.ordered():
            content, calls = parse_tool_calls(s.text, self.parallel) if self.tools else (s.text, [])
            choices.append(R.chat_choice(s, self.ctx.tokens.token_str, self.want_logprobs, content, calls))
        return R.chat_response(self.run.request_id, self.created, self.ctx.model_name, choices, self.usage())

    def opening_chunks(self) -> list[dict]:
        return [self._chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]) for s in self.ordered()]

    def delta_chunk(self, st: R.ChoiceState, co: CompletionOutput, first: bool) -> dict | None:
        lp = R.chat_logprobs(co.logprobs or [], self.ctx.tokens.token_str) if self.want_logprobs else None
        finish = co.finish_reason
        if not self.tools:
            delta = {"content": co.text} if co.text or not finish else {}
        else:
            stream = self.tool_streams[st.index]
            done = len(stream.calls)
            text, calls = stream.feed(co.text)
            if finish:
                text += stream.close()
            delta = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = [{"index": done + j, **c} for j, c in enumerate(calls)]
            if finish == "stop" and stream.calls:
                finish = "tool_calls"
            if not delta and not finish and lp is None:
                return None  # held back: it may be the start of a tool call
        return self._chunk([{"index": st.index, "delta": delta, "logprobs": lp,
                             "finish_reason": finish, "stop_reason": co.stop_reason}])


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
                    chunk = fmt.delta_chunk(st, co, first)
                    if chunk is not None:
                        yield chunk
        if fmt.include_usage:
            yield R.usage_chunk(fmt.chunk_object, run.request_id, fmt.created, ctx.model_name, fmt.usage())
    except Exception as exc:  # any failure must reach the client as an error event
        err = as_api_error(exc)
        if err.status >= 500:
            log.exception("stream %s failed", run.request_id)
        yield err.body()
    finally:
        run.close()
        ctx.unregister(run)
    yield DONE

"""HTTP side of the benchmark: one streamed OpenAI-style request becomes one `RequestRecord`.

Every request is sent with `stream: true` and `stream_options.include_usage: true`. Timing starts
right before the request is sent and each content chunk (non-empty `text`, `delta.content` or
`delta.reasoning_content`) is timestamped on arrival. A non-200 answer, a `data: {"error": ...}`
event, a stream that ends without `[DONE]` or a finish_reason, a timeout or a transport failure
each give a failed record with a distinct error label; nothing raises out of `stream_request`.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

import httpx

from server.bench.records import RequestRecord
from server.bench.sse import SseDecoder, SseEvent
from server.bench.workloads import Prompt


@dataclass
class RequestOptions:
    """What every request carries besides its prompt."""

    model: str
    endpoint: str = "completions"
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)
    lora_ids: int = 0  # > 0: request i names llama.cpp's adapter id i % lora_ids (`lora: [{id, scale}]`)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def sampling(self, max_tokens: int) -> dict:
        """The generation fields shared by every endpoint (streaming, usage, budget, sampling)."""
        body = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def build_request(opts: RequestOptions, prompt: Prompt, index: int = 0) -> tuple[str, dict]:
    """The path and JSON body for one OpenAI-style streamed request (the `index`-th of the run)."""
    if opts.endpoint == "chat":
        body = {"model": opts.model, "messages": prompt.as_messages()}
    else:
        body = {"model": opts.model, "prompt": prompt.as_text()}
    body.update(opts.sampling(prompt.max_tokens))
    if opts.lora_ids:  # adapters alternating request by request (llama.cpp's field; cellserve reads it too)
        body["lora"] = [{"id": index % opts.lora_ids, "scale": 1.0}]
    return ENDPOINT_PATHS[opts.endpoint], body


def chunk_text(data: dict) -> str:
    """The generated text carried by one stream chunk (completions or chat), '' if none."""
    choices = data.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if isinstance(choice.get("text"), str):
        return choice["text"]
    delta = choice.get("delta") or {}
    for key in ("content", "reasoning_content", "reasoning"):
        if isinstance(delta.get(key), str) and delta[key]:
            return delta[key]
    return ""


def _finished(data: dict) -> bool:
    choices = data.get("choices") or []
    return any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


def error_message(body: bytes) -> str:
    """The `error.message` of an OpenAI-shaped error body, else the raw body text."""
    text = body.decode("utf-8", errors="replace")
    try:
        err = json.loads(text).get("error", text)
    except (json.JSONDecodeError, AttributeError):
        return text
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


@dataclass
class _StreamState:
    t0: float
    chunks: list[float] = field(default_factory=list)
    chars: int = 0
    parts: list[str] = field(default_factory=list)
    usage: dict | None = None
    finished: bool = False
    done: bool = False
    error: object | None = None

    def on_event(self, event: SseEvent, now: float) -> None:
        if event.done:
            self.done = True
            return
        if event.data is None:
            return
        if event.error is not None:
            self.error = event.error
            return
        text = chunk_text(event.data)
        if text:
            self.chunks.append(now - self.t0)
            self.chars += len(text)
            self.parts.append(text)
        if isinstance(event.data.get("usage"), dict):
            self.usage = event.data["usage"]
        self.finished = self.finished or _finished(event.data)


def _finish_record(rec: RequestRecord, st: _StreamState, end: float) -> RequestRecord:
    rec.latency = end - st.t0
    rec.chunk_times = st.chunks
    rec.ttft = st.chunks[0] if st.chunks else None
    rec.output_chars = st.chars
    rec.output_digest = hashlib.sha1("".join(st.parts).encode()).hexdigest()[:16]
    usage = st.usage or {}
    if isinstance(usage.get("completion_tokens"), int):
        rec.output_tokens, rec.usage_reported = usage["completion_tokens"], True
    else:
        rec.output_tokens = len(st.chunks)
    if isinstance(usage.get("prompt_tokens"), int):
        rec.prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        rec.cached_tokens = details["cached_tokens"]
    drafts = usage.get("cellserve_draft_tokens")  # cellserve's (OpenAI's fields are Predicted Outputs only)
    if isinstance(drafts, dict) and isinstance(drafts.get("accepted"), int):
        rec.accepted_draft_tokens = drafts["accepted"]
        rec.rejected_draft_tokens = drafts.get("rejected")
    if st.error is not None:
        msg = st.error.get("message", st.error) if isinstance(st.error, dict) else st.error
        return rec.fail("sse_error", f"error event mid-stream: {msg}")
    if not (st.done or st.finished):
        return rec.fail("truncated", "stream ended without [DONE] or a finish_reason")
    return rec


async def stream_request(
    client: httpx.AsyncClient, url: str, body: dict, rec: RequestRecord, headers: dict[str, str],
    text_sink: list[str] | None = None,
) -> RequestRecord:
    """POST `body` to `url` as a stream and fill `rec` with what was observed; never raises.
    With `text_sink`, the generated text's pieces are appended to it (the multi-turn workload resends them)."""
    st = _StreamState(t0=time.perf_counter())
    decoder = SseDecoder()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.latency = time.perf_counter() - st.t0
                message = error_message(await resp.aread())
                return rec.fail(str(resp.status_code), message)
            async for line in resp.aiter_lines():
                for event in decoder.feed(line):
                    st.on_event(event, time.perf_counter())
            for event in decoder.flush():
                st.on_event(event, time.perf_counter())
    except httpx.TimeoutException as exc:
        rec.latency = time.perf_counter() - st.t0
        return rec.fail("timeout", f"{type(exc).__name__}: {exc}; raise --timeout if the server is just slow")
    except httpx.HTTPError as exc:
        rec.latency = time.perf_counter() - st.t0
        return rec.fail("transport", f"{type(exc).__name__}: {exc}")
    if text_sink is not None:
        text_sink.extend(st.parts)
    return _finish_record(rec, st, time.perf_counter())


async def fetch_default_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    """The id of the first model listed by GET /v1/models; raises RuntimeError saying what to do."""
    try:
        resp = await client.get(f"{base_url}/v1/models", headers=headers)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot reach {base_url}/v1/models ({exc}); is the server up? check --url") from None
    if resp.status_code != 200:
        raise RuntimeError(
            f"GET {base_url}/v1/models answered {resp.status_code}: {error_message(resp.content)}; "
            "pass --model (and --api-key if the server needs one)"
        )
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"GET {base_url}/v1/models listed no model; pass --model NAME") from None

"""Shared state of one server: the engine's lifecycle as HTTP sees it, and what every route shares
with it: the request `Limits`, the `TokenizerService` (text <-> token ids) and the Prometheus metrics.

Lifecycle: `loading` -> `ready` -> `draining` -> `stopped` (or `failed` if loading raised or the engine
loop died: then `on_fatal` is called, so the CLI exits non-zero and a supervisor restarts it). Only
`ready` admits work; every other state answers 503 with a message saying why, so a client can tell
"try again soon" (loading) from "go elsewhere" (draining/stopped/failed). The engine is either given
ready-made (tests inject a real engine built from a tiny model) or built by a factory in a worker
thread after the socket is open, so `/health` can say 503 while the model loads.
"""

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.api.outputs import EngineStats, RequestOutput
from server.errors import APIError

log = logging.getLogger("cellserve.server")

if TYPE_CHECKING:  # the server never imports the engine (torch) at run time; it is injected
    from engine.api.client import EngineClient
    from server.serving import GenerationRun

EngineFactory = Callable[[], "EngineClient"]


# --- Request limits checked at the edge, before any expensive work: one source for each limit.
#
# Guarantees:
# - A body larger than `max_body_bytes` is refused with 413 before it is read: at once when its
#   `Content-Length` says so, else as soon as the bytes received pass the limit (chunked uploads), so a
#   20 MB body never costs 20 MB of parsing, tokenization or memory (`server.app.BodySizeLimit`).
# - A request with more prompts than `max_prompts`, or more choices (prompts x n) than `max_choices`,
#   is a 400 naming the field before anything is tokenized or submitted.
# - Text that cannot fit the model's context whatever it tokenizes to is refused before tokenization
#   (see `TokenizerService`); the exact token check against the context and the pool comes after.

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
DEFAULT_MAX_PROMPTS = 256
DEFAULT_MAX_CHOICES = 1024


@dataclass(frozen=True)
class Limits:
    """What one request may ask for. `cellserve serve --max-body-bytes/--max-prompts/--max-choices`."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompts: int = DEFAULT_MAX_PROMPTS
    max_choices: int = DEFAULT_MAX_CHOICES

    def check_choices(self, n_prompts: int, n: int) -> None:
        if n_prompts > self.max_prompts:
            raise APIError(400, f"{n_prompts} prompts in one request; at most {self.max_prompts} are allowed "
                           "(--max-prompts): split the request", param="prompt", code="too_many_prompts")
        if n_prompts * n > self.max_choices:
            raise APIError(400, f"{n_prompts} prompts x n={n} = {n_prompts * n} choices in one request; at most "
                           f"{self.max_choices} are allowed (--max-choices): lower n or send fewer prompts",
                           param="n", code="too_many_choices")

    def body_too_large(self, size: int | None = None) -> str:
        got = f" ({size} bytes)" if size is not None else ""
        return (f"request body is too large{got}: at most {self.max_body_bytes} bytes are accepted "
                "(--max-body-bytes); send a shorter prompt")


class ServerContext:
    def __init__(self, engine: Union["EngineClient", EngineFactory], *, served_model_name: str | None = None,
                 api_key: str | None = None, shutdown_grace_s: float = 30.0,
                 on_fatal: Callable[[str], None] | None = None, limits: Limits | None = None):
        self._factory: EngineFactory | None = None if _is_engine(engine) else engine
        self.engine: EngineClient | None = engine if _is_engine(engine) else None
        self.state = "loading"
        self.error: str | None = None
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.shutdown_grace_s = shutdown_grace_s
        self.on_fatal = on_fatal
        self.limits = limits or Limits()
        self.tokens: TokenizerService | None = None
        self.metrics = ServerMetrics(self._stats)
        self.runs: dict[str, GenerationRun] = {}
        self._load_task: asyncio.Task | None = None

    @staticmethod
    def of(request: Request) -> "ServerContext":
        return request.app.state.ctx

    # lifecycle
    async def startup(self) -> None:
        if self.engine is not None:
            self._attach(self.engine)
        else:
            self._load_task = asyncio.create_task(self._load())

    async def _load(self) -> None:
        try:
            engine = await asyncio.to_thread(self._factory)
            self._attach(engine)
        except BaseException as exc:  # noqa: BLE001 -- reported through /health and the callback
            self.state, self.error = "failed", f"the model failed to load ({type(exc).__name__}: {exc})"
            log.error("%s", self.error)
            if self.on_fatal is not None:
                self.on_fatal(self.error)

    def _attach(self, engine: "EngineClient") -> None:
        self.engine = engine
        engine.on_failure = self._engine_failed
        self.tokens = TokenizerService(engine.tokenizer, max_model_len=engine.max_model_len)
        if self.served_model_name is None:
            self.served_model_name = engine.model_name
        self.state = "ready"

    def _engine_failed(self, reason: str) -> None:
        """Called on the engine's thread if its loop dies: stop answering 200 and let the process exit."""
        self.state, self.error = "failed", f"the engine loop stopped ({reason})"
        log.critical("%s; the server will exit", self.error)
        if self.on_fatal is not None:
            self.on_fatal(self.error)

    def begin_drain(self) -> None:
        """Stop admitting new work (SIGTERM); in-flight requests keep going until the grace ends."""
        if self.state in ("ready", "loading"):
            self.state = "draining"

    async def shutdown(self) -> None:
        self.begin_drain()
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
        for run in list(self.runs.values()):
            run.close()
        if self.engine is not None:
            await self.engine.shutdown(self.shutdown_grace_s)
        self.state = "stopped"

    # what routes use
    def require_engine(self) -> "EngineClient":
        if self.state == "ready":
            return self.engine
        why = {
            "loading": "the model is still loading; retry in a few seconds",
            "draining": "the server is shutting down and admits no new requests",
            "stopped": "the server has stopped",
            "failed": f"{self.error}; see the server log",
        }[self.state]
        raise APIError(503, why, code="unavailable")

    @property
    def model_name(self) -> str:
        return self.served_model_name or "cellserve"

    def _stats(self):
        return self.engine.stats() if self.engine is not None and self.state != "loading" else None

    # in-flight runs, for POST /v1/requests/{id}/cancel
    def register(self, run: "GenerationRun") -> None:
        self.runs[run.request_id] = run

    def unregister(self, run: "GenerationRun") -> None:
        if self.runs.get(run.request_id) is run:
            del self.runs[run.request_id]

    async def cancel_request(self, request_id: str) -> None:
        """Cancel a registered run (all its engine requests), else ask the engine (RequestNotFound if unknown)."""
        run = self.runs.get(request_id)
        if run is not None:
            run.cancel()
        else:
            await self.engine.cancel(request_id)


def _is_engine(obj: Any) -> bool:
    return hasattr(obj, "submit") and hasattr(obj, "tokenizer")


# --- The tokenizer layer between HTTP and the engine: text and chat messages <-> token ids.
#
# Guarantees:
# - Encoding, chat templating and whole-text decoding run in a worker thread (`asyncio.to_thread`),
#   never on the event loop and never on the engine's loop thread, so a long prompt cannot stall
#   other streams.
# - A prompt never reaches the engine empty: an empty text becomes `[bos]` when the model has a BOS
#   token, otherwise it is a 400 that says so.
# - Per-token strings (for logprobs) come from a bounded cache, so formatting top-k logprobs does not
#   re-run the tokenizer for tokens it has already seen.
# - Text that cannot fit the context whatever it tokenizes to (more non-whitespace characters than
#   `max_model_len` x the longest vocabulary entry) is a 400 `context_length_exceeded` before any
#   tokenization, so a huge prompt costs a count, not seconds of CPU and a tokenizer's memory.
#   (Whitespace is not counted: some tokenizers drop it. A tokenizer that maps a long unknown word to
#   one token could in principle fit such text; no prompt worth serving looks like that.)

TOKEN_STR_CACHE = 1 << 16


class TokenizerService:
    """Wraps a Hugging Face tokenizer (only `encode`, `decode`, `apply_chat_template` are used)."""

    def __init__(self, tokenizer: Any, max_model_len: int | None = None):
        self.tok = tokenizer
        self._token_strs: dict[int, str] = {}
        self.max_chars = None if max_model_len is None else max_model_len * _longest_token_chars(tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    async def prompt_ids(self, prompt: str | Sequence[int] | None, messages: Sequence[Any] | None = None, *,
                         add_generation_prompt: bool = True, add_special_tokens: bool = True,
                         empty_ok: bool = False, tools: list[dict] | None = None) -> list[int]:
        """The one way a request's prompt becomes token ids: chat `messages` through the template, text
        through the tokenizer, token ids as given. `empty_ok`: an empty text stays empty (a sequence
        continuation with nothing to append, /tokenize of ""); otherwise it becomes `[bos]` (or a 400).
        `tools`: tool definitions for a chat template that renders them."""
        if messages is not None:
            dicts = [m.as_template_dict() for m in messages]
            return await self.encode_chat(dicts, add_generation_prompt=add_generation_prompt, tools=tools)
        if isinstance(prompt, str):
            if not prompt and empty_ok:
                return []
            return await self.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt or [])

    async def encode(self, text: str, *, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self.check_length([text], param)
        ids = await asyncio.to_thread(self.tok.encode, text, add_special_tokens=add_special_tokens)
        return self._non_empty(list(ids), param)

    async def encode_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                          tools: list[dict] | None = None) -> list[int]:
        """`tools`: OpenAI tool definitions for templates that render them (`server.chat.supports_tools`)."""
        if not self.has_chat_template:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions with a "
                           "plain prompt instead", param="messages")
        self.check_length([m.get("content") or "" for m in messages] + [json.dumps(tools or "")], "messages")
        extra = {"tools": tools} if tools else {}
        try:
            out = await asyncio.to_thread(
                self.tok.apply_chat_template, list(messages), add_generation_prompt=add_generation_prompt,
                tokenize=True, return_dict=False, **extra,
            )
        except Exception as exc:  # jinja errors: template rejects the roles/order given
            raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages") from exc
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        if ids and isinstance(ids[0], list):  # some tokenizers return a batch of one
            ids = ids[0]
        return self._non_empty([int(t) for t in ids], "messages")

    async def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return await asyncio.to_thread(self.tok.decode, list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        """The text of one token (may be a partial character for byte-level vocabularies)."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tok.decode([token_id])
            if len(self._token_strs) < TOKEN_STR_CACHE:
                self._token_strs[token_id] = s
        return s

    def check_length(self, texts: Sequence[str], param: str) -> None:
        """400 `context_length_exceeded` if these texts cannot fit the context whatever their tokens."""
        if self.max_chars is None:
            return
        chars = sum(len(t) - sum(t.count(w) for w in _WHITESPACE) for t in texts)
        if chars > self.max_chars:
            raise APIError(400, f"{param} has {chars} non-whitespace characters, more than can fit the model's "
                           f"context (at most {self.max_chars}); shorten it", param=param,
                           code="context_length_exceeded")

    def _non_empty(self, ids: list[int], param: str) -> list[int]:
        if ids:
            return ids
        bos = getattr(self.tok, "bos_token_id", None)
        if bos is not None:
            return [bos]
        raise APIError(400, f"{param} is empty after tokenization and the model has no BOS token to start "
                       "from; send some text", param=param)


_WHITESPACE = (" ", "\n", "\t", "\r")


def _longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for (vocabulary entries, byte-level ones 1 char a byte)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:  # a tokenizer without a vocabulary listing: assume a generous bound
        return 64
    return max((len(t) for t in get_vocab()), default=64) or 64


# --- Prometheus metrics: engine gauges/counters read at scrape time, latency histograms observed here.
#
# Guarantees:
# - Each app has its own `CollectorRegistry`, so several servers (or tests) in one process never clash.
# - Engine state (running/waiting requests, cells used/free, preemptions, token counters) is read from
#   `engine.stats()` when /metrics is scraped, so it is never stale and costs nothing per token.
# - TTFT and end-to-end latency come from the engine's own `Timing` (queued -> first token ->
#   finished); inter-token latency is the gap between consecutive token-bearing outputs of one engine
#   request as the server receives them. Names follow vLLM's (`cellserve:` prefix instead of `vllm:`).

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


class EngineCollector(Collector):
    """Reads `EngineStats` at scrape time; yields nothing while the engine is not loaded."""

    def __init__(self, stats: Callable[[], EngineStats | None]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:
            return
        gauges = {
            "num_requests_running": ("Requests generating (in the running batch).", s.running),
            "num_requests_waiting": ("Requests waiting to be admitted.", s.waiting),
            "num_idle_sequences": ("Persistent sequences with nothing running.", s.idle_sequences),
            "cells_total": ("KV cells in the pool.", s.n_cells),
            "cells_used": ("KV cells owned by at least one sequence (shared cells count once).", s.cells_used),
            "cells_free": ("KV cells owned by nobody.", s.cells_free),
            "kv_cache_usage_perc": ("Fraction of KV cells in use (0-1).", s.cells_used / max(1, s.n_cells)),
            "read_len": ("Length of the cell read window.", s.read_len),
        }
        counters = {
            "num_preemptions": ("Sequences preempted (cells freed, recomputed later).", s.preemptions),
            "prompt_tokens": ("Prompt tokens prefilled.", s.prompt_tokens),
            "generation_tokens": ("Tokens generated.", s.generated_tokens),
            "engine_steps": ("Engine forward steps (ticks).", s.steps),
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", s.prefix_queried_tokens),
            "prefix_cache_hits": ("Prompt tokens whose cells came from the prefix cache.", s.prefix_hit_tokens),
        }
        for family, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, (doc, value) in table.items():
                yield family(f"cellserve:{name}", doc, value=value)


class ServerMetrics:
    """The app's registry plus the latency histograms and request counters the routes feed."""

    def __init__(self, stats: Callable[[], EngineStats | None]):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.ttft = Histogram("cellserve:time_to_first_token_seconds", "Queued to first generated token.",
                              buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("cellserve:inter_token_latency_seconds",
                             "Gap between consecutive token-bearing outputs of one request.",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("cellserve:e2e_request_latency_seconds", "Queued to finished.",
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.finished = Counter("cellserve:request_success", "Finished engine requests by finish reason.",
                                ["finished_reason"], registry=reg)
        self.errors = Counter("cellserve:request_errors",
                              "Requests answered with an error, by HTTP status (/health probes excluded).",
                              ["status"], registry=reg)
        reg.register(EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestObserver:
    """Feeds one engine request's outputs into the histograms (one instance per engine request)."""

    def __init__(self, metrics: ServerMetrics | None):
        self._m = metrics
        self._last: float | None = None
        self._done: set[int] = set()

    def observe(self, out: RequestOutput) -> None:
        if self._m is None:
            return
        t = time.monotonic()
        if any(c.token_ids for c in out.outputs):
            if self._last is not None:
                self._m.itl.observe(t - self._last)
            self._last = t
        for c in out.outputs:
            if c.finish_reason and c.index not in self._done:
                self._done.add(c.index)
                self._m.finished.labels(finished_reason=c.finish_reason).inc()
        if out.finished:
            self._finish(out)

    def abandon(self, n: int) -> None:
        """The client left before the end: every choice not yet finished counts as cancelled."""
        if self._m is None:
            return
        for index in range(n):
            if index not in self._done:
                self._done.add(index)
                self._m.finished.labels(finished_reason="cancelled").inc()

    def _finish(self, out: RequestOutput) -> None:
        tm = out.timing
        if tm.first_token is not None and tm.queued:
            self._m.ttft.observe(max(0.0, tm.first_token - tm.queued))
        if tm.finished is not None and tm.queued:
            self._m.e2e.observe(max(0.0, tm.finished - tm.queued))

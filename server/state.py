"""Shared state of one server (`ServerContext`): the engine's lifecycle as HTTP sees it, and the registry
of in-flight runs; it holds what every route shares (`Limits`, the `TokenizerService`, the metrics).

Lifecycle: `loading` -> `ready` -> `draining` -> `stopped` (or `failed` if loading raised or the engine
loop died: then `on_fatal` is called, so the CLI exits non-zero and a supervisor restarts it). Only
`ready` admits work; every other state answers 503 with a message saying why, so a client can tell
"try again soon" (loading) from "go elsewhere" (draining/stopped/failed). The engine is either given
ready-made (tests inject a real engine built from a tiny model) or built by a factory in a worker
thread after the socket is open, so `/health` can say 503 while the model loads.
"""

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, Union

from fastapi import Request

from server.errors import APIError
from server.limits import Limits
from server.metrics import ServerMetrics
from server.tokenization import TokenizerService

log = logging.getLogger("cellserve.server")

if TYPE_CHECKING:  # the server never imports the engine (torch) at run time; it is injected
    from engine.api.client import EngineClient

EngineFactory = Callable[[], "EngineClient"]


class Run(Protocol):
    """What the registry needs of an in-flight run (`server.generation.run.GenerationRun` is one): state.py
    sits below every API surface and imports none of them."""

    request_id: str

    def cancel(self) -> None: ...

    def close(self) -> None: ...


class ServerContext:
    def __init__(self, engine: Union["EngineClient", EngineFactory], *, served_model_name: str | None = None,
                 api_key: str | None = None, shutdown_grace_s: float = 30.0,
                 on_fatal: Callable[[str], None] | None = None, limits: Limits | None = None,
                 state_dir: str | None = None):
        self._factory: EngineFactory | None = None if _is_engine(engine) else engine
        self.engine: EngineClient | None = engine if _is_engine(engine) else None
        self.state = "loading"
        self.error: str | None = None
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.shutdown_grace_s = shutdown_grace_s
        self.on_fatal = on_fatal
        self.limits = limits or Limits()
        self.state_dir = state_dir  # --state-dir: the server keeps its stored responses there too
        self.tokens: TokenizerService | None = None
        self.metrics = ServerMetrics(self.engine_stats, self._memory)
        self.runs: dict[str, Run] = {}
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

    def engine_stats(self):
        """The engine's counters as of its last tick (`EngineClient.stats`); None while loading or without one."""
        return self.engine.stats() if self.engine is not None and self.state != "loading" else None

    def _memory(self):
        return self.engine.memory() if self.engine is not None and self.state != "loading" else None

    # in-flight runs, for POST /v1/requests/{id}/cancel
    def register(self, run: Run) -> None:
        self.runs[run.request_id] = run

    def unregister(self, run: Run) -> None:
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

"""One engine replica: the single server's own app (`server.app.build_app`) inside a Ray Serve replica.

The ingress does not speak HTTP to a replica: it hands it the request (method, path, query, headers,
body) through a Ray Serve handle, and the replica drives the same FastAPI app in-process through ASGI
and streams the ASGI messages back (`forward`). So a replica answers exactly as `cellserve serve`
would (same routes, validation, errors, SSE), and only Ray moves bytes between processes.

Guarantees:
- every id the replica makes carries its index and a boot token (`engine.api.ids.set_tag`), so sequence
  and cancel routes come back here; an id of an earlier start of this replica (its process died and
  Ray Serve started a new one) is answered `404` with a message saying the replica restarted;
- `forward` first yields `("accepted",)` at once, so the ingress can tell a replica that is not
  there (dead, restarting) from one that is still generating, and never waits forever;
- if the ingress goes away (client disconnect, cancel), the app sees `http.disconnect` and cancels the
  request, exactly as with a direct client;
- `check_health` fails when the engine loop died, so Ray Serve replaces the replica.
"""

import argparse
import asyncio
import logging
import os
import secrets
from collections.abc import AsyncIterator

from ray import serve

from engine.api.ids import set_tag
from server.errors import error_body
from server.ray_serve.routing import parse_id, replica_name, replica_tag, routed_id

log = logging.getLogger("cellserve.replica")
APP_EXIT_WAIT_S = 2.0  # after the response (or a disconnect), how long the app may take to finish


class Replica:
    """A Ray Serve deployment class (wrapped by `serve.deployment` in `ingress.build_application`)."""

    async def __init__(self, index: int, args: argparse.Namespace):
        from server.app import build_app
        from server.config import engine_factory, limits_of

        logging.basicConfig(level=getattr(args, "log_level", "info").upper())
        self.index, self.name, self.boot = index, replica_name(index), secrets.token_hex(4)
        set_tag(replica_tag(index, self.boot))
        engine = await asyncio.to_thread(engine_factory(args))  # the model loads before Serve routes here
        self.app = build_app(engine, served_model_name=args.served_model_name, api_key=args.api_key,
                             shutdown_grace_s=args.shutdown_grace, limits=limits_of(args))
        self.ctx = self.app.state.ctx
        await self.ctx.startup()
        log.info("replica %s (boot %s, pid %d) ready", self.name, self.boot, os.getpid())

    # ----- what the ingress calls ------------------------------------------------------------
    def info(self) -> dict:
        """State for `/health` and least-loaded routing (never waits on the engine loop)."""
        stats = self.ctx.engine_stats()
        load = stats.running + stats.waiting if stats is not None else 0
        return {"replica": self.name, "boot": self.boot, "state": self.ctx.state, "error": self.ctx.error,
                "pid": os.getpid(), "load": load}

    def check_health(self) -> None:
        """Ray Serve's probe: raising makes Serve kill and replace this replica."""
        if self.ctx.state == "failed":
            raise RuntimeError(f"replica {self.name}: {self.ctx.error}")

    async def forward(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> AsyncIterator[tuple]:
        """Yield `("accepted",)`, `("start", status, headers)`, then `("body", bytes)` chunks."""
        yield ("accepted",)
        stale = self._stale(path)
        if stale is not None:
            yield ("start", 404, [(b"content-type", b"application/json")])
            yield ("body", stale)
            return
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": query, "root_path": "", "headers": headers, "client": ("127.0.0.1", 0),
                 "server": ("127.0.0.1", 0), "state": {}}
        async for message in run_asgi(self.app, scope, body):
            if message["type"] == "http.response.start":
                yield ("start", message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body" and message.get("body"):
                yield ("body", bytes(message["body"]))

    def _stale(self, path: str) -> bytes | None:
        """The 404 body for an id made by an earlier start of this replica, else None."""
        some_id = routed_id(path)
        parsed = parse_id(some_id) if some_id else None
        if parsed is None or parsed[1] == self.boot:
            return None
        import json

        what = "sequence" if path.startswith("/v1/sequences/") else "request"
        message = (f"{what} {some_id!r} is gone: replica {self.name} restarted since it was created (its "
                   f"process died and Ray Serve started a new one, with an empty cell pool); create a new "
                   f"{what}")
        return json.dumps(error_body(404, message, param="sequence_id" if what == "sequence" else "request_id",
                                     code="replica_restarted")).encode()

    async def __del__(self) -> None:
        """Ray Serve stops the replica (scale down, shutdown): drain and stop the engine."""
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            await ctx.shutdown()


async def run_asgi(app, scope: dict, body: bytes) -> AsyncIterator[dict]:
    """Drive an ASGI app for one request in this event loop and yield what it sends.

    The body is delivered at once; after that `receive()` waits until the caller stops listening
    (the generator is closed or cancelled), then says `http.disconnect`, so the app cancels work
    nobody will read. The app gets `APP_EXIT_WAIT_S` to finish after that, then is cancelled."""
    queue: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await queue.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await queue.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await queue.get()
            if message is None:
                break
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), APP_EXIT_WAIT_S)
            except BaseException:  # noqa: BLE001 -- the app may not outlive its request
                task.cancel()
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.warning("the app raised after answering: %r", task.exception())


def replica_deployment(threads: int | None, name: str):
    """The `Replica` class as a Ray Serve deployment: one replica each (the index is its identity)."""
    return serve.deployment(Replica, name=name, num_replicas=1, max_ongoing_requests=100_000,
                            health_check_period_s=2.0, health_check_timeout_s=30.0,
                            graceful_shutdown_timeout_s=60.0,
                            ray_actor_options={"num_cpus": threads or 1})


class ReplicaGroup:
    """The application's root deployment: it only keeps the replicas deployed (the ingress calls them)."""

    def __init__(self, *replicas):
        self.n = len(replicas)

    def size(self) -> int:
        return self.n


def build_application(args: argparse.Namespace):
    """N replica deployments (`replica-0`...) under one Serve application; `args` are the serve flags."""
    threads = args.threads_per_replica or args.threads
    args = argparse.Namespace(**{**vars(args), "threads": threads})
    bound = [replica_deployment(threads, f"replica-{i}").bind(i, args) for i in range(args.replicas)]
    group = serve.deployment(ReplicaGroup, name="group", num_replicas=1, ray_actor_options={"num_cpus": 0})
    return group.bind(*bound)

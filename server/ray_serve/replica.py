"""The engine deployment: one engine and the single server's own app (`server.app.build_app`) per replica.

One Ray Serve deployment (`num_replicas` N, or `autoscaling_config`), `@serve.ingress`: Serve's HTTP proxy
(on every node) sends each request to a replica chosen by `router.CellserveRouter`, and the replica answers
with the single server's app behind `edge.Edge` (aggregated routes, ids held elsewhere). Other deployments
and replicas call `forward` through a handle: the same app, driven in-process through ASGI, its messages
streamed back.

Guarantees:
- every id the replica makes carries its Serve replica id (`engine.api.ids.set_tag`), so the router sends
  requests on it back here; an id of a replica that is gone is answered `404` saying so (`edge`);
- before Serve removes a replica (scale-down), its idle fork families move to the other replicas with their
  cells, keeping their ids (`hand_off`; the target's cached prefixes are cleared first: an import only takes
  free cells); at a whole-application shutdown (`cluster.stop`) nothing moves;
- `check_health` fails when the engine loop died, so Serve replaces the replica.
"""

import argparse
import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator

from ray import serve

from engine.api.ids import set_tag
from server.errors import error_body
from server.ray_serve.edge import Edge, gone_body, replay
from server.ray_serve.routing import RecentPrefixes, parse_id, prompt_text, replica_tag, routed_id

log = logging.getLogger("cellserve.replica")
APP_EXIT_WAIT_S = 2.0  # after the response (or a disconnect), how long the app may take to finish
CALL_TIMEOUT_S = 10.0  # a call to the cluster deployment (register, where, stop) never waits longer
STATS_PERIOD_S = 1.0  # how often Serve asks each replica for its routing stats
HAND_OFF_TRIES = 5


@serve.ingress()
class Engine:
    """A Ray Serve deployment class (options in `build_application`)."""

    async def __init__(self, args: argparse.Namespace, cluster, engine_name: str, app_name: str):
        from server.app import build_app
        from server.config import engine_factory, limits_of

        logging.basicConfig(level=getattr(args, "log_level", "info").upper())
        self.uid = serve.get_replica_context().replica_id.unique_id
        self.cluster, self.engine_name, self.app_name = cluster, engine_name, app_name
        self.prefixes = RecentPrefixes()
        self.imported = False
        self.stopping = False  # set when Serve stops this replica: it takes no more families
        set_tag(replica_tag(self.uid))
        engine = await asyncio.to_thread(engine_factory(args))  # the model loads before Serve routes here
        self.server_app = build_app(engine, served_model_name=args.served_model_name, api_key=args.api_key,
                             shutdown_grace_s=args.shutdown_grace, limits=limits_of(args), ui=not args.no_ui)
        self.ctx = self.server_app.state.ctx
        await self._cluster_call("register", self.uid)
        log.info("replica %s (pid %d) ready", self.uid, os.getpid())

    def __serve_build_asgi_app__(self):
        return Edge(self)

    def engine_handle(self):
        return serve.get_deployment_handle(self.engine_name, app_name=self.app_name)

    async def _cluster_call(self, method: str, *args):
        try:
            return await asyncio.wait_for(getattr(self.cluster, method).remote(*args), CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 -- the cluster deployment is advisory for these calls
            log.warning("cluster.%s failed: %s: %s", method, type(exc).__name__, exc)
            return None

    # ----- what Serve and the other deployments call --------------------------------------------------
    async def record_routing_stats(self) -> dict:
        """Serve's routing-stats push (every `STATS_PERIOD_S`): load, recent prompt prefixes, ids moved here.
        Also re-registers with the cluster deployment (a restarted cluster replica learns the replicas)."""
        stats = self.ctx.engine_stats()
        held: list[str] = []
        if self.imported and self.ctx.state == "ready":
            held = [s.seq_id for s in await self.ctx.engine.list_sequences() if parse_id(s.seq_id) != self.uid]
        asyncio.ensure_future(self._cluster_call("register", self.uid))
        return {"load": stats.running + stats.waiting if stats is not None else 0,
                "prefixes": self.prefixes.report(), "held": held}

    def info(self, replica: str | None = None) -> dict:
        """This replica's state for `/health` (never waits on the engine loop); `replica`: who the caller meant."""
        if replica is not None and replica != self.uid:
            return {"status": "gone", "error": f"replica {replica} is not running"}
        stats = self.ctx.engine_stats()
        load = stats.running + stats.waiting if stats is not None else 0
        return {"status": "ok" if self.ctx.state == "ready" else self.ctx.state, "error": self.ctx.error,
                "pid": os.getpid(), "node": _node_id(),
                "load": load}

    def check_health(self) -> None:
        """Ray Serve's probe: raising makes Serve kill and replace this replica."""
        if self.ctx.state == "failed":
            raise RuntimeError(f"replica {self.uid}: {self.ctx.error}")

    async def holds(self, some_id: str) -> bool:
        """Whether a request on `some_id` is this replica's to answer (it made it, or it was moved here)."""
        made_by = parse_id(some_id)
        if made_by is None or made_by == self.uid:
            return True
        return self.imported and self.ctx.state == "ready" and some_id in {
            s.seq_id for s in await self.ctx.engine.list_sequences()}

    async def forward(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                      replica: str | None = None, avoid: str | None = None) -> AsyncIterator[tuple]:
        """Yield `("start", status, headers)`, then `("body", bytes)` chunks: the app's answer to this request.
        `replica`: the caller meant this replica (a `404` if the router found it gone); `avoid` is for the router."""
        if replica is not None and replica != self.uid:
            yield ("start", 404, [(b"content-type", b"application/json")])
            yield ("body", gone_body("replica", replica, "replica"))
            return
        some_id = routed_id(path, body)
        if some_id is not None and not await self.holds(some_id):
            yield ("start", 404, [(b"content-type", b"application/json")])
            yield ("body", gone_body("sequence" if "/sequences/" in path else "request", some_id, parse_id(some_id)))
            return
        if path == "/v1/sequences/import" and method == "POST":
            if self.stopping:  # a family handed off to a replica that is itself stopping would be lost
                yield ("start", 503, [(b"content-type", b"application/json"), self.name_header()])
                yield ("body", json.dumps(error_body(503, f"replica {self.uid} is stopping; import elsewhere",
                                                     code="replica_stopping")).encode())
                return
            self.imported = True
        self.note_prompt(path, body)
        async for message in run_asgi(self.server_app, http_scope(method, path, query, headers), body):
            if message["type"] == "http.response.start":
                yield ("start", message["status"], [*message.get("headers", []), self.name_header()])
            elif message["type"] == "http.response.body" and message.get("body"):
                yield ("body", bytes(message["body"]))

    def name_header(self) -> tuple[bytes, bytes]:
        return (b"x-cellserve-replica", self.uid.encode())

    def note_prompt(self, path: str, body: bytes) -> None:
        text = prompt_text(path, body)
        if text is not None:
            self.prefixes.record(text)

    # ----- scale-down ------------------------------------------------------------------------------
    async def hand_off(self) -> None:
        """Move every idle fork family to the other replicas (ids kept), unless the whole application stops.

        Serve calls this (through the app's lifespan shutdown) after it stopped routing here and the
        requests in flight finished. A family whose move fails stays (and is lost with the replica): logged."""
        if self.ctx.state != "ready" or await self._cluster_call("stopping") is not False:
            return
        engine = self.ctx.engine
        listed = await engine.list_sequences()
        ids = {s.seq_id for s in listed}
        roots = [s.seq_id for s in sorted(listed, key=lambda s: s.created) if s.parent not in ids]
        handle = self.engine_handle().options(stream=True)
        moved = 0
        for root in roots:
            try:
                archive = await engine.export_sequences(root, family=True)
                for _ in range(HAND_OFF_TRIES):  # a target that is stopping too refuses: try another
                    # an import only uses free cells: the target's cached prefixes go first, so the cells fit
                    _, _, target = await collect(handle.forward.remote(
                        "DELETE", "/v1/cache/prefixes", b"", [], b"", avoid=self.uid))
                    status, content, _ = await collect(handle.forward.remote(
                        "POST", "/v1/sequences/import", b"", [(b"content-type", b"application/octet-stream")],
                        archive, replica=target))
                    if status not in (503, 404):  # 404: the target went between the two calls
                        break
                    await asyncio.sleep(STATS_PERIOD_S)
                if status != 200:
                    raise RuntimeError(f"import answered {status}: {content[:200]!r}")
                family = [s for s in listed if s.seq_id in _family_ids(root, listed)]
                await self._cluster_call("moved_to", [s.seq_id for s in family], target)
                for s in sorted(family, key=lambda s: -s.created):  # leaves first
                    await engine.delete(s.seq_id)
                moved += 1
            except Exception as exc:  # noqa: BLE001 -- one family's failure does not stop the others
                log.error("replica %s: the family of %s could not move: %s", self.uid, root, exc)
        if roots:
            log.info("replica %s: moved %d of %d families before stopping", self.uid, moved, len(roots))
        await asyncio.sleep(2 * STATS_PERIOD_S)  # let every router see the new holders' `held` ids

    async def stop(self) -> None:
        self.stopping = True
        await self.hand_off()
        await self._cluster_call("unregister", self.uid)
        await self.ctx.shutdown()


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _family_ids(root: str, listed) -> set[str]:
    out, frontier = {root}, {root}
    while frontier:
        frontier = {s.seq_id for s in listed if s.parent in frontier} - out
        out |= frontier
    return out


async def collect(gen) -> tuple[int, bytes, str]:
    """(status, body, replica header) of a streamed `forward` answer."""
    status, chunks, replica = 0, [], ""
    async for item in gen:
        if item[0] == "start":
            status = item[1]
            replica = next((v.decode() for k, v in item[2] if k.lower() == b"x-cellserve-replica"), "")
        elif item[0] == "body":
            chunks.append(item[1])
    return status, b"".join(chunks), replica


def http_scope(method: str, path: str, query: bytes, headers: list) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
            "root_path": "", "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
            "state": {}}


async def run_asgi(app, scope: dict, body: bytes) -> AsyncIterator[dict]:
    """Drive an ASGI app for one request in this event loop and yield what it sends.

    The body is delivered at once; after that `receive()` waits until the caller stops listening
    (the generator is closed or cancelled), then says `http.disconnect`, so the app cancels work
    nobody will read. The app gets `APP_EXIT_WAIT_S` to finish after that, then is cancelled."""
    queue: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()

    async def until_gone() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    receive = replay(body, until_gone)

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

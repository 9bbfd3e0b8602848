"""The `cluster` deployment: what needs every engine replica, asked one by one through the engine's handle.

One small replica (no CPU reserved). It knows the running engine replicas (each registers when it starts,
again with every routing-stats push, and unregisters when it stops; one that the router no longer finds
is dropped), and answers the aggregated routes an engine replica hands it (`edge`): `/health`, `/metrics`
(every replica's samples labelled `replica="<id>"`), `/v1/cache` (totals and each view), `DELETE
/v1/cache/prefixes`, `GET /v1/sequences` (each with its `replica`), and moves and drains (`moves`). It also
keeps where families went at a scale-down (`moved`, `where`) until the new holders report them, and whether
the whole application is stopping (then replicas stop without moving anything).

Each call to a replica names it (`Engine.forward(..., replica=id)`; `router` sends it there) and gives up
after `PROBE_TIMEOUT_S`: a replica that does not answer is reported, never waited on.
"""

import asyncio
import json
import logging
from collections import OrderedDict

from ray import serve

from server.errors import error_body
from server.metrics import CONTENT_TYPE
from server.ray_serve.moves import MoveFailed, Mover, known_replica
from server.ray_serve.replica import collect
from server.ray_serve.routing import merge_metrics, sum_cache

log = logging.getLogger("cellserve.cluster")
PROBE_TIMEOUT_S = 10.0
MOVE_TIMEOUT_S = 120.0
MOVED_ENTRIES = 100_000
JSON = [(b"content-type", b"application/json")]
Answer = tuple[int, list, bytes]


def as_json(status: int, data: dict) -> Answer:
    return status, JSON, json.dumps(data).encode()


class Cluster:
    """A Ray Serve deployment class (options in `replica.build_application`)."""

    def __init__(self, engine_name: str, app_name: str):
        self.engine_name, self.app_name = engine_name, app_name
        self.replicas: dict[str, None] = {}
        self.moved: OrderedDict[str, str] = OrderedDict()
        self._stopping = False

    # ----- bookkeeping the replicas call ----------------------------------------------------------
    def register(self, uid: str) -> None:
        self.replicas[uid] = None

    def unregister(self, uid: str) -> None:
        self.replicas.pop(uid, None)

    def stop(self) -> None:
        """The whole application is being deleted: replicas stop without moving their families."""
        self._stopping = True

    def stopping(self) -> bool:
        return self._stopping

    def moved_to(self, ids: list[str], uid: str) -> None:
        for some_id in ids:
            self.moved[some_id] = uid
        while len(self.moved) > MOVED_ENTRIES:
            self.moved.popitem(last=False)

    def where(self, some_id: str) -> str | None:
        return self.moved.get(some_id)

    # ----- asking the replicas --------------------------------------------------------------------
    async def send(self, uid: str, method: str, path: str, query: bytes, headers: list, body: bytes = b"",
                   timeout: float = PROBE_TIMEOUT_S) -> tuple[int, bytes]:
        handle = serve.get_deployment_handle(self.engine_name, app_name=self.app_name).options(stream=True)
        try:
            status, content, _ = await asyncio.wait_for(
                collect(handle.forward.remote(method, path, query, headers, body, replica=uid)), timeout)
        except Exception as exc:  # noqa: BLE001 -- a replica that fails is reported, not raised
            why = "no answer in time" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            return 503, json.dumps(error_body(503, f"replica {uid}: {why}", code="replica_unavailable")).encode()
        if status == 404 and b'"replica_gone"' in content and path in ("/health", "/v1/sequences"):
            self.unregister(uid)  # the router found no such replica: it is gone
        return status, content

    async def each(self, method: str, path: str, headers: list) -> dict[str, tuple[int, bytes]]:
        uids = list(self.replicas)
        got = await asyncio.gather(*(self.send(u, method, path, b"", headers) for u in uids))
        return dict(zip(uids, got))

    async def handle(self, method: str, path: str, query: bytes, headers: list, body: bytes) -> Answer:
        """The answer to an aggregated route (`edge.AGGREGATED`, moves, drains)."""
        headers = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"transfer-encoding")]
        if path == "/health":
            return await self.health()
        if path.endswith(("/move", "/drain")):
            return await self.move_or_drain(path, headers, body)
        got = await self.each(method, path, headers)
        for status, content in got.values():
            if status not in (200, 503, 404) or (status == 404 and b'"replica_gone"' not in content):
                return status, JSON, content  # a replica refused it (401...): that replica's error as is
        ok = {uid: content for uid, (status, content) in got.items() if status == 200}
        down = sorted(set(got) - set(ok))
        if path == "/metrics":
            return 200, [(b"content-type", CONTENT_TYPE.encode())], merge_metrics(
                {uid: c.decode() for uid, c in ok.items()}).encode()
        views = {uid: json.loads(c) for uid, c in ok.items()}
        if path == "/v1/cache":
            return as_json(200, {**sum_cache(views), "unavailable_replicas": down})
        if path == "/v1/cache/prefixes":
            freed = {uid: v["freed_cells"] for uid, v in views.items()}
            return as_json(200, {"object": "cache.prefixes.cleared", "freed_cells": sum(freed.values()),
                                 "replicas": freed, "unavailable_replicas": down})
        data = [dict(s, replica=uid) for uid, v in views.items() for s in v["data"]]
        return as_json(200, {"object": "list", "data": data, "unavailable_replicas": down})

    async def info(self, uid: str) -> dict:
        handle = serve.get_deployment_handle(self.engine_name, app_name=self.app_name)
        try:
            got = await asyncio.wait_for(handle.info.remote(replica=uid), PROBE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 -- a replica that fails is reported, not raised
            why = "no answer in time" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            return {"status": "unavailable", "error": why}
        if got["status"] == "gone":
            self.unregister(uid)
        return got

    async def health(self) -> Answer:
        uids = list(self.replicas)
        view = dict(zip(uids, await asyncio.gather(*(self.info(u) for u in uids))))
        bad = [f"{uid} ({v['status']}{': ' + v['error'] if v.get('error') else ''})" for uid, v in view.items()
               if v["status"] != "ok"]
        if view and not bad:
            return as_json(200, {"status": "ok", "replicas": view})
        message = (f"degraded: {len(bad)} of {len(view)} replicas not ready: {', '.join(bad)}" if view
                   else "no engine replica is running yet")
        return 503, [*JSON, (b"retry-after", b"5")], json.dumps(
            {**error_body(503, message, code="replica_unavailable"), "replicas": view}).encode()

    async def move_or_drain(self, path: str, headers: list, body: bytes) -> Answer:
        replicas = list(self.replicas)

        async def send(uid: str, method: str, route: str, query: bytes, content: bytes) -> tuple[int, bytes]:
            return await self.send(uid, method, route, query, headers, content, MOVE_TIMEOUT_S)

        mover = Mover(send, replicas)
        name = path.split("/")[3]
        try:
            if path.endswith("/drain"):
                return as_json(200, await mover.drain(known_replica(name, replicas)))
            try:
                wanted = json.loads(body or b"{}")
            except ValueError:
                return as_json(400, error_body(400, 'the body must be JSON: {"replica": "<replica id>"}'))
            target = known_replica(wanted.get("replica") if isinstance(wanted, dict) else None, replicas)
            ids = await mover.move(name, target, self.moved.get(name))
        except MoveFailed as exc:
            return exc.response.status_code, JSON, bytes(exc.response.body)
        return as_json(200, {"object": "sequence.moved", "replica": target, "ids": ids})

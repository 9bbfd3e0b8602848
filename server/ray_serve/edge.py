"""What a replica does with a request from Serve's HTTP proxy before the single server's app sees it.

Hand-written ASGI (a few branches in front of the app; nothing in Serve does this):
- the aggregated routes (`/health`, `/metrics`, `/v1/cache`, `DELETE /v1/cache/prefixes`, `GET /v1/sequences`,
  moves, drains) go to the `cluster` deployment, which asks every replica;
- a request on an id this replica does not hold: if the family moved (scale-down) it is handed on to the
  holder through the engine deployment's handle, else `404` saying which replica made the id and that it is
  gone (its process died or Serve removed it);
- `POST /v1/responses` continuing a stored response of another replica (`previous_response_id`, in the
  body, which the proxy does not show the router) is handed on the same way;
- prompts of stateless requests are noted for the replica's reported prefixes (`routing`);
- every answer says which replica gave it (`X-Cellserve-Replica`).
The lifespan is the app's own, except that before the engine stops the replica hands its families off.
"""

import asyncio
import json
import re

from server.errors import error_body
from server.ray_serve.routing import parse_id, routed_id

AGGREGATED = {("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/cache"), ("DELETE", "/v1/cache/prefixes"),
              ("GET", "/v1/sequences")}
CLUSTER_POST = re.compile(r"^/v1/(?:sequences/[^/]+/move|replicas/[^/]+/drain)$")
PROMPT_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/sequences", "/v1/responses")
CLUSTER_TIMEOUT_S = 300.0  # a drain moves many families


def gone_body(what: str, some_id: str, made_by: str | None) -> bytes:
    message = (f"{what} {some_id!r} is gone: replica {made_by} that held it is no longer running (its process "
               f"died or the deployment scaled down without moving it), and it did not move elsewhere; create a "
               f"new {what}" if what != "replica" else
               f"replica {some_id!r} is not running (it restarted or was removed); see GET /health for the replicas")
    return json.dumps(error_body(404, message, code="replica_gone")).encode()


async def read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def replay(body: bytes, receive):
    """A `receive` that gives the already-read body once, then the client's own messages (its disconnect)."""
    given = False

    async def again() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def respond(send, status: int, headers: list, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Edge:
    """The ASGI app Serve mounts on each engine replica (`Engine.__serve_build_asgi_app__`)."""

    def __init__(self, replica):
        self.replica, self.app = replica, replica.server_app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        name = self.replica.name_header()

        async def named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), name]}
            await send(message)

        method, path = scope["method"], scope["path"]
        if (method, path) in AGGREGATED or (method == "POST" and CLUSTER_POST.match(path)):
            body = await read_body(receive)
            status, headers, content = await asyncio.wait_for(self.replica.cluster.handle.remote(
                method, path, scope["query_string"], scope["headers"], body), CLUSTER_TIMEOUT_S)
            return await respond(named, status, headers, content)
        some_id = routed_id(path)
        if some_id is not None and not await self.replica.holds(some_id):
            where = await self.replica._cluster_call("where", some_id)
            if where is not None and where != self.replica.uid:
                return await self.hand_on(scope, receive, send, await read_body(receive), where)
            made_by = parse_id(some_id)
            what = "sequence" if path.startswith("/v1/sequences/") else "request"
            return await respond(named, 404, [(b"content-type", b"application/json")],
                                 gone_body(what, some_id, made_by))
        if method == "POST" and path in PROMPT_PATHS:
            body = await read_body(receive)
            previous = routed_id(path, body) if path == "/v1/responses" else None
            if previous is not None and not await self.replica.holds(previous):  # the proxy had no hints
                return await self.hand_on(scope, receive, send, body, None)
            self.replica.note_prompt(path, body)
            return await self.app(scope, replay(body, receive), named)
        return await self.app(scope, receive, named)

    async def hand_on(self, scope, receive, send, body: bytes, replica: str | None) -> None:
        """Answer with another replica's answer, its `X-Cellserve-Replica` included (the router picks it by
        the id in the path or body, or `replica`); a client that goes away cancels it there."""
        gen = self.replica.engine_handle().options(stream=True).forward.remote(
            scope["method"], scope["path"], scope["query_string"], scope["headers"], body, replica=replica)

        async def relay() -> None:
            async for item in gen:
                if item[0] == "start":
                    await send({"type": "http.response.start", "status": item[1], "headers": item[2]})
                else:
                    await send({"type": "http.response.body", "body": item[1], "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(relay()), asyncio.ensure_future(gone())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                gen.cancel()
                work.cancel()
        if work.done() and not work.cancelled():
            work.result()

    async def lifespan(self, receive, send) -> None:
        ctx = self.replica.ctx
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await ctx.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.replica.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

"""The scale-out ingress: one OpenAI-compatible HTTP endpoint in front of N engine replicas.

A FastAPI app served by uvicorn in the `cellserve serve --replicas` process (not Ray Serve's proxy: that
proxy adds its own `X-Request-ID`, which would shadow the response id clients read there). It calls the
replicas through Ray Serve deployment handles. It never parses a route's body beyond choosing a replica; the replica answers with the single server's own app, and
this app relays status, headers and body (SSE chunk by chunk). Each response says which replica
answered (`X-Cellserve-Replica`) and why (`X-Cellserve-Route`: `affinity`, `prefix` or `least-loaded`,
see `routing`). Aggregated routes: `/health`, `/v1/cache`, `DELETE /v1/cache/prefixes` (every replica), `/metrics`,
`GET /v1/sequences` (`/v1/models`: any replica). Moves: `POST /v1/sequences/{id}/move` and
`POST /v1/replicas/{name}/drain` (see `moves`).
A stateless request a full replica refuses (`429`) is retried on the others first.

Faults: a replica that does not accept a request within `ACCEPT_TIMEOUT_S` (dead, restarting), or
dies before answering, gives `503` with `Retry-After`; one that dies mid-stream ends the stream with
an error event and `[DONE]`. Nothing waits forever on a dead replica; the other replicas keep serving.
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from server.errors import error_body
from server.limits import Limits
from server.metrics import CONTENT_TYPE
from server.middleware import BodySizeLimit, HeadAsGet
from server.ray_serve.moves import MoveFailed, Mover, replica_index
from server.ray_serve.routing import (
    PREFIX_SLACK,
    LoadBoard,
    PrefixTable,
    merge_metrics,
    parse_id,
    prompt_text,
    replica_name,
    routed_id,
    sum_cache,
)

log = logging.getLogger("cellserve.ingress")
ACCEPT_TIMEOUT_S = 30.0  # a replica that has not accepted a request by then is treated as down
PROBE_TIMEOUT_S = 5.0  # /health and the load poll: a replica silent this long is degraded
POLL_S = 0.5  # how often replica loads are refreshed for least-loaded routing
RETRY_AFTER_S = 5
HOP = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive"}


class ReplicaDown(Exception):
    """A replica died, or is not there, while this request needed it."""


class ReplicaSet:
    """The replicas' handles and what routing knows about them (one event loop: no locks)."""

    def __init__(self, handles: list):
        self.handles = handles
        self.board = LoadBoard(len(handles))
        self.prefixes = PrefixTable()
        self.boots: list[str | None] = [None] * len(handles)
        self._poller: asyncio.Task | None = None

    def ensure_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await self.infos()
            await asyncio.sleep(POLL_S)

    async def info(self, i: int) -> dict:
        """`Replica.info()` of replica i, or a degraded entry saying why there is none."""
        try:
            info = await asyncio.wait_for(self.handles[i].info.remote(), PROBE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 -- any failure is a degraded replica
            why = "no answer (restarting?)" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            return {"replica": replica_name(i), "state": "unreachable", "error": why}
        self.board.reported[i] = info["load"]
        if self.boots[i] is not None and self.boots[i] != info["boot"]:
            log.warning("replica %s restarted (boot %s -> %s)", info["replica"], self.boots[i], info["boot"])
            self.prefixes.forget(i)
        self.boots[i] = info["boot"]
        if info["state"] == "ready":
            self.board.mark_up(i)
        return info

    async def infos(self) -> list[dict]:
        return list(await asyncio.gather(*(self.info(i) for i in range(len(self.handles)))))

    def choose(self, path: str, body: bytes) -> tuple[int, str]:
        some_id = routed_id(path, body)
        parsed = parse_id(some_id) if some_id else None
        if parsed is not None and parsed[0] < len(self.handles):
            return parsed[0], "affinity"
        text = prompt_text(path, body)
        best = self.board.least_loaded()
        if text is not None:
            hit = self.prefixes.lookup(text)
            if (hit is not None and self.board.up(hit)
                    and self.board.load(hit) <= self.board.load(best) + PREFIX_SLACK):
                best, policy = hit, "prefix"
            else:
                policy = "least-loaded"
            self.prefixes.record(text, best)
            return best, policy
        return best, "least-loaded"

    def open(self, i: int, method: str, path: str, query: bytes, headers: list, body: bytes) -> "ReplicaAnswer":
        """Send a request to replica i; it counts as in flight there from now, before anything is awaited,
        so a burst of requests routed in one go sees each earlier choice (not only the last poll)."""
        gen = self.handles[i].options(stream=True).forward.remote(method, path, query, headers, body)
        return ReplicaAnswer(self, i, gen)

    async def call(self, i: int, method: str, path: str, query: bytes, headers: list, body: bytes
                   ) -> "ReplicaAnswer":
        """Send a request to replica i and wait for its status and headers. Raises ReplicaDown."""
        return await self.open(i, method, path, query, headers, body).start()

    def _down(self, i: int, exc: BaseException) -> ReplicaDown:
        self.board.mark_down(i)
        why = "did not accept it in time" if isinstance(exc, TimeoutError) else f"failed ({type(exc).__name__})"
        log.warning("replica %s %s", replica_name(i), why)
        return ReplicaDown(f"replica {replica_name(i)} {why} while handling this request; it is being "
                           f"restarted; retry in a few seconds")



class ReplicaAnswer:
    """One replica's answer in flight: status, headers, then body chunks. `close()` (idempotent) cancels
    the replica's side (its app sees a disconnect) and releases the replica's in-flight count."""

    def __init__(self, replicas: ReplicaSet, i: int, gen):
        self.replicas, self.i, self.gen = replicas, i, gen
        self.status, self.headers = 0, []
        self.closed = False
        replicas.board.inflight[i] += 1

    async def start(self) -> "ReplicaAnswer":
        """Wait until the replica accepts the request and sends status and headers. Raises ReplicaDown."""
        try:
            await asyncio.wait_for(self.gen.__anext__(), ACCEPT_TIMEOUT_S)  # ("accepted",)
            start = await self.gen.__anext__()
        except (Exception, TimeoutError) as exc:
            self.close()
            raise self.replicas._down(self.i, exc) from exc
        except BaseException:  # cancelled (the client went away): stop the replica's work too
            self.close()
            raise
        self.status, self.headers = start[1], [(k, v) for k, v in start[2] if k.lower() not in HOP]
        return self

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.replicas.board.inflight[self.i] -= 1
            self.gen.cancel()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for item in self.gen:
                yield item[1]
        except Exception as exc:  # the replica died mid-answer
            raise self.replicas._down(self.i, exc) from exc
        finally:
            self.close()

    async def read(self) -> bytes:
        try:
            return b"".join([c async for c in self.chunks()])
        finally:
            self.close()

    def is_event_stream(self) -> bool:
        return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.headers)


def unavailable(message: str, **extra) -> JSONResponse:
    return JSONResponse({**error_body(503, message, code="replica_unavailable"), **extra}, status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_S)})


def replica_error(got: dict[str, tuple[int, bytes, list]]) -> Response | None:
    """An aggregated route's answer when some replica refused it (401, 404, ...): that replica's error as
    is. A replica that is down (503) is not an error here: the route reports it among its fields."""
    for status, body, _ in got.values():
        if status not in (200, 503):
            return Response(body, status_code=status, media_type="application/json")
    return None


def build_ingress_app(handles: list, limits: Limits) -> FastAPI:
    """The ingress app over replica handles (`replica_handles`); run it with uvicorn like the single server."""
    app = FastAPI(title="cellserve (scale-out)", redirect_slashes=False, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.replicas = ReplicaSet(list(handles))

    def replicas(request: Request) -> ReplicaSet:
        rs = request.app.state.replicas
        rs.ensure_polling()
        return rs

    def fwd_headers(request: Request) -> list:
        return [(k, v) for k, v in request.scope["headers"] if k.lower() not in HOP]

    @app.get("/health")
    async def health(request: Request) -> Response:
        infos = await replicas(request).infos()
        view = {i["replica"]: {k: i.get(k) for k in ("state", "error", "pid", "load")} for i in infos}
        bad = [i for i in infos if i["state"] != "ready"]
        if not bad:
            return JSONResponse({"status": "ok", "replicas": view})
        names = ", ".join(f"{i['replica']} ({i['state']}{': ' + i['error'] if i.get('error') else ''})" for i in bad)
        return unavailable(f"degraded: {len(bad)} of {len(infos)} replicas not ready: {names}", replicas=view)

    async def each(request: Request, path: str, method: str = "GET") -> dict[str, tuple[int, bytes, list]]:
        rs = replicas(request)

        async def one(i: int):
            try:
                answer = await rs.call(i, method, path, b"", fwd_headers(request), b"")
                return answer.status, await answer.read(), answer.headers
            except ReplicaDown as exc:
                return 503, json.dumps(error_body(503, str(exc), code="replica_unavailable")).encode(), []

        out = await asyncio.gather(*(one(i) for i in range(len(rs.handles))))
        return {replica_name(i): r for i, r in enumerate(out)}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        got = await each(request, "/metrics")
        text = merge_metrics({name: body.decode() for name, (status, body, _) in got.items() if status == 200})
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/cache")
    async def cache(request: Request) -> Response:
        got = await each(request, "/v1/cache")
        if (error := replica_error(got)) is not None:
            return error
        views = {name: json.loads(body) for name, (status, body, _) in got.items() if status == 200}
        down = [name for name, (status, _, _) in got.items() if status != 200]
        return JSONResponse({**sum_cache(views), "unavailable_replicas": down})

    @app.delete("/v1/cache/prefixes")
    async def clear_prefixes(request: Request) -> Response:
        got = await each(request, "/v1/cache/prefixes", "DELETE")
        if (error := replica_error(got)) is not None:
            return error
        freed = {name: json.loads(body)["freed_cells"] for name, (status, body, _) in got.items() if status == 200}
        return JSONResponse({"object": "cache.prefixes.cleared", "freed_cells": sum(freed.values()),
                             "replicas": freed, "unavailable_replicas": sorted(set(got) - set(freed))})

    @app.get("/v1/sequences")
    async def list_sequences(request: Request) -> Response:
        got = await each(request, "/v1/sequences")
        if (error := replica_error(got)) is not None:
            return error
        data = [dict(s, replica=name) for name, (status, body, _) in got.items() if status == 200
                for s in json.loads(body)["data"]]
        return JSONResponse({"object": "list", "data": data})

    def mover(request: Request) -> Mover:
        rs = replicas(request)

        async def send(i: int, method: str, path: str, query: bytes, body: bytes) -> tuple[int, bytes]:
            try:
                answer = await rs.call(i, method, path, query, fwd_headers(request), body)
                return answer.status, await answer.read()
            except ReplicaDown as exc:
                return 503, json.dumps(error_body(503, str(exc), code="replica_unavailable")).encode()

        return Mover(send, len(rs.handles))

    @app.post("/v1/sequences/{seq_id}/move")
    async def move(seq_id: str, request: Request) -> Response:
        """Move the sequence's fork family to `{"replica": "rN"}` (see `moves`)."""
        try:
            body = json.loads(await request.body() or b"{}")
            m = mover(request)
            target = replica_index(body.get("replica") if isinstance(body, dict) else None, m.n)
            ids = await m.move(seq_id, target)
        except ValueError:
            return JSONResponse(error_body(400, 'the body must be JSON: {"replica": "r1"}'), status_code=400)
        except MoveFailed as exc:
            return exc.response
        return JSONResponse({"object": "sequence.moved", "replica": replica_name(target), "ids": ids},
                            headers={"X-Cellserve-Replica": replica_name(target)})

    @app.post("/v1/replicas/{name}/drain")
    async def drain(name: str, request: Request) -> Response:
        """Move every fork family off replica `name` to the others (see `moves`; the replica stays up)."""
        m = mover(request)
        try:
            return JSONResponse(await m.drain(replica_index(name, m.n), replicas(request).board.load))
        except MoveFailed as exc:
            return exc.response

    @app.api_route("/{path:path}", methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    async def proxy(request: Request) -> Response:
        rs = replicas(request)
        body = await request.body()
        path, query = request.url.path, request.scope["query_string"]
        i, policy = rs.choose(path, body)
        tried = {i}
        while True:
            answer = rs.open(i, request.method, path, query, fwd_headers(request), body)
            try:  # a non-streaming answer starts only when it is complete: watch the client meanwhile
                started = await until_disconnect(request, answer.start())
            except ReplicaDown as exc:
                return unavailable(str(exc), replica=replica_name(i))
            if started is None:
                answer.close()  # the start may never have run: stop the replica's side here
                return Response(status_code=499)  # the client is gone; nobody reads this
            untried = [j for j in range(len(rs.handles)) if j not in tried and rs.board.up(j)]
            if answer.status != 429 or policy == "affinity" or not untried:
                break
            answer.close()  # that replica's queue is full: the client sees 429 only when every queue is
            i = min(untried, key=rs.board.load)
            tried.add(i)
            policy = "least-loaded"
        if answer.is_event_stream():
            response = StreamingResponse(relay(answer.chunks()), status_code=answer.status)
        else:
            try:
                content = await until_disconnect(request, answer.read())
            except ReplicaDown as exc:
                return unavailable(str(exc), replica=replica_name(i))
            if content is None:
                return Response(status_code=499)
            response = Response(content, status_code=answer.status)
        for k, v in answer.headers:
            response.headers.append(k.decode("latin-1"), v.decode("latin-1"))
        response.headers.update({"X-Cellserve-Route": policy, "X-Cellserve-Replica": replica_name(i)})
        return response

    app.add_middleware(HeadAsGet)
    app.add_middleware(BodySizeLimit, limits=limits)
    return app


async def until_disconnect(request: Request, work):
    """Await `work`; None if the client went away first: then `work` is cancelled, and with it the
    replica's side (its app sees a disconnect and cancels the request, as the single server does)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()  # its cleanup cancels the replica's side
        return None
    return task.result()


async def relay(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """SSE chunks as the replica sends them; if the replica dies, an error event and `[DONE]`."""
    try:
        async for chunk in chunks:
            yield chunk
    except ReplicaDown as exc:
        yield f"data: {json.dumps(error_body(503, str(exc), code='replica_unavailable'))}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        await chunks.aclose()


def replica_handles(app_name: str, n: int) -> list:
    """Handles to the N replica deployments of a running application (`launch.deploy`)."""
    return [serve.get_deployment_handle(f"replica-{i}", app_name=app_name) for i in range(n)]

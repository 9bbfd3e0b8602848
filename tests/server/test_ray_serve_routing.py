"""Scale-out routing without a cluster: the router (`CellserveRouter.choose_replicas` on stand-in replicas with
the stats Serve would give it), the proxy middleware that shows it a request's body (`RoutingHints`), and the
helpers (ids, replica counts, metrics merging, fork families). Needs the `ray` extra, not a running Ray.
"""

import asyncio
import json
import pickle
from types import SimpleNamespace

import pytest
import ray.serve  # noqa: F401  (the ray extra: make installs it; no skip)
from ray.serve._private.common import RequestMetadata, StreamingHTTPRequest
from ray.serve.request_router import PendingRequest

from server.ray_serve.moves import family_of, roots
from server.ray_serve.proxy_routing import PREFIX_HEADER, PROXY_HEADER, ROUTE_ID_HEADER, RoutingHints
from server.ray_serve.router import CellserveRouter
from server.ray_serve.routing import RecentPrefixes, merge_metrics, parse_id, parse_replicas, routed_id

SYSTEM = "You are a terse assistant who answers in one line. " * 8


def replica(uid: str, **stats) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid), routing_stats=stats)


def ranks(candidates, args: list, kwargs: dict, call_method: str) -> list[list[str]]:
    """The router's ranking for a request with these handle-call arguments (made in the loop, as Serve does)."""
    router = object.__new__(CellserveRouter)  # choose_replicas needs no router state

    async def go():
        pending = PendingRequest(args=args, kwargs=kwargs, metadata=RequestMetadata(
            request_id="x", internal_request_id="y", call_method=call_method))
        return await CellserveRouter.choose_replicas(router, candidates, pending)

    return [[r.replica_id.unique_id for r in rank] for rank in asyncio.run(go())]


def test_prefix_routing_prefers_the_replica_that_reported_the_prompt():
    """The router (run here on stand-in replicas carrying the stats Serve would give it): an id goes to the
    replica that made it or reports holding it; a prompt whose prefix a replica reports goes there unless it
    is `PREFIX_SLACK` busier; otherwise every replica, least reported load first."""
    system = SYSTEM
    held = RecentPrefixes()
    held.record(system + "first question")

    def choose(candidates, path: str, body: bytes = b"", **kw) -> list[list[str]]:
        return ranks(candidates, ["POST", path, b"", [], body], kw, "forward")

    a, b = replica("aaaaaaaa", load=0, prefixes=held.report()), replica("bbbbbbbb", load=0, prefixes=[])
    c = replica("cccccccc", load=0, prefixes=[], held=["seq-rdeadbeef-" + "1" * 32])
    body = json.dumps({"prompt": system + "another question", "max_tokens": 2}).encode()
    assert choose([b, a, c], "/v1/completions", body)[0] == ["aaaaaaaa"]
    unheld = choose([b, c], "/v1/completions", body)
    assert len(unheld) == 1 and sorted(unheld[0]) == ["bbbbbbbb", "cccccccc"]
    busy = replica("aaaaaaaa", load=9, prefixes=held.report())
    assert "aaaaaaaa" not in choose([busy, b], "/v1/completions", body)[0][:1]
    assert choose([a, b, c], f"/v1/sequences/seq-rbbbbbbbb-{'2' * 32}/completions") == [["bbbbbbbb"]]
    assert choose([a, b, c], f"/v1/sequences/seq-rdeadbeef-{'1' * 32}") == [["cccccccc"]]  # moved there
    assert choose([a, b, c], "/v1/models", replica="cccccccc") == [["cccccccc"]]
    assert "aaaaaaaa" not in choose([a, b], "/v1/sequences/import", avoid="aaaaaaaa")[0]
    loaded = replica("bbbbbbbb", load=5)
    assert choose([loaded, a], "/v1/models")[0] == ["aaaaaaaa", "bbbbbbbb"]



def test_routing_helpers():
    assert routed_id("/v1/sequences/seq-x/fork") == "seq-x" and routed_id("/v1/requests/cmpl-y/cancel") == "cmpl-y"
    assert routed_id("/v1/sequences") is None and parse_id("seq-" + "a" * 32) is None
    assert routed_id("/v1/responses/resp-r1-x/input_items") == "resp-r1-x"
    assert routed_id("/v1/responses", b'{"input": "hi", "previous_response_id": "resp-r2-y"}') == "resp-r2-y"
    assert routed_id("/v1/responses", b'{"input": "hi"}') is None
    assert routed_id("/v1/responses", b'{"previous_response_id": 5}') is None
    assert routed_id("/v1/responses", b'[not json "previous_response_id"') is None
    assert parse_id("seq-rab12cd34-" + "a" * 32) == "ab12cd34" and parse_id("resp_rAB12cd34-" + "f" * 32) == "AB12cd34"
    assert parse_replicas("3") == 3 and parse_replicas("auto:1-3") == (1, 3)
    for bad in ("0", "auto:3-1", "auto:1", "x"):
        with pytest.raises(ValueError, match="auto:MIN-MAX"):
            parse_replicas(bad)
    text = {"r0": '# HELP x_total X.\n# TYPE x_total counter\nx_total{k="a"} 1.0\n# TYPE y gauge\ny 2.0\n',
            "r1": '# HELP x_total X.\n# TYPE x_total counter\nx_total{k="a"} 3.0\n# TYPE y gauge\ny 4.0\n'}
    assert merge_metrics(text).splitlines() == [
        "# HELP x_total X.", "# TYPE x_total counter", 'x_total{replica="r0",k="a"} 1.0',
        'x_total{replica="r1",k="a"} 3.0', "# TYPE y gauge", 'y{replica="r0"} 2.0', 'y{replica="r1"} 4.0']



def test_move_helpers():
    listed = [{"id": "a", "parent": None, "created": 1}, {"id": "b", "parent": "a", "created": 2},
              {"id": "c", "parent": "b", "created": 3}, {"id": "d", "parent": None, "created": 0}]
    assert {s["id"] for s in family_of("c", listed)} == {"a", "b", "c"}
    assert roots(listed) == ["d", "a"]


def through_proxy(headers: list, path: str = "/v1/completions", body: bytes = b"") -> tuple[dict, bytes, list]:
    """Run `RoutingHints` on one request: (the scope it passed on, the body the app read, the answer's headers)."""
    seen: dict = {}

    async def app(scope, receive, send) -> None:
        message = await receive()
        seen["scope"], seen["body"] = scope, message["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            seen["answer"] = message["headers"]

    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-length", str(len(body)).encode()), *headers]}
    asyncio.run(RoutingHints(app)(scope, receive, send))
    return seen["scope"], seen["body"], seen["answer"]


def test_the_proxy_shows_the_router_a_prompts_prefix_and_previous_response():
    """The proxy middleware puts the prompt's prefix keys and a `previous_response_id` in the scope's headers
    (a client's own copies dropped), passes the body on intact and names its node; the router, given the
    pickled request as Serve's proxy sends it, routes by them: to the replica reporting the prefix, or holding
    the response."""
    prompt = SYSTEM + "a question"
    body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
    scope, passed, answer = through_proxy([(PREFIX_HEADER, b"forged"), (ROUTE_ID_HEADER, b"resp-forged")], body=body)
    assert passed == body and dict(answer)[PROXY_HEADER]
    hints = [(k, v) for k, v in scope["headers"] if k in (PREFIX_HEADER, ROUTE_ID_HEADER)]
    assert hints == [(PREFIX_HEADER, ",".join(RecentPrefixes.keys(prompt)).encode())]
    previous = f"resp-rbbbbbbbb-{'3' * 32}"
    later, _, _ = through_proxy([], "/v1/responses", json.dumps({"input": "go on",
                                                                  "previous_response_id": previous}).encode())
    assert (ROUTE_ID_HEADER, previous.encode()) in later["headers"]
    short, _, _ = through_proxy([(PREFIX_HEADER, b"forged")], body=b'{"prompt": "hi"}')
    assert not [k for k, _ in short["headers"] if k == PREFIX_HEADER]

    held = RecentPrefixes()
    held.record(SYSTEM + "first question")
    a, b = replica("aaaaaaaa", load=0, prefixes=held.report()), replica("bbbbbbbb", load=0, prefixes=[])

    def proxied(candidates, s: dict) -> list[list[str]]:  # as Serve's proxy sends it: the pickled scope only
        return ranks(candidates, [pickle.dumps(StreamingHTTPRequest(asgi_scope=s, proxy_actor_name="proxy"))], {},
                     "__call__")

    for _ in range(5):  # not a tie broken by chance
        assert proxied([b, a], scope)[0] == ["aaaaaaaa"]
        assert proxied([a, b], later) == [["bbbbbbbb"]]
    assert sorted(proxied([a, b], short)[0]) == ["aaaaaaaa", "bbbbbbbb"]

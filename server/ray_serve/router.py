"""cellserve's Ray Serve `RequestRouter`: which engine replica a request goes to (see `routing` for the rules).

Serve runs one instance in every process that sends the engine deployment requests (each node's HTTP
proxy, the `cluster` deployment, a replica handing a request on); each learns the replicas and their
reported routing stats (`Engine.record_routing_stats`: `load`, `prefixes`, `held`) from Serve's controller,
so there is no poll loop of ours. It subclasses Serve's public `RequestRouter` without `FIFOMixin`: a
replica found for a request is given to that request (affinity must not be handed to another).

What a request shows the router (`View`): through the proxy, the pickled ASGI scope (method, path, headers:
not the body, which the replica reads from the proxy later), with the prefix keys and `previous_response_id`
that `proxy_routing.RoutingHints` put in its headers from the body; through a handle call of
`Engine.forward`, every argument, body included, and the `replica` the caller names (moves, aggregated routes;
`Engine.info` too).
"""

import pickle
import random
from dataclasses import dataclass, field

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from server.ray_serve.proxy_routing import header_hints
from server.ray_serve.routing import (
    PREFIX_SLACK,
    RecentPrefixes,
    longest_match,
    parse_id,
    prompt_text,
    routed_id,
)


@dataclass
class View:
    """What the router knows of one request."""

    path: str = ""
    body: bytes = b""  # b"": the router cannot see it
    named: str | None = None  # the replica the caller names
    avoid: str | None = None  # a replica not to choose (a hand-off's source)
    keys: list[str] = field(default_factory=list)  # prompt prefix keys, shortest first
    some_id: str | None = None  # the sequence/response the request is about


def request_view(request: PendingRequest) -> View:
    args, kwargs = request.args, request.kwargs
    if request.metadata.call_method == "forward" and len(args) >= 5:
        path, body = args[1], args[4]
        text = prompt_text(path, body) if body else None
        return View(path, body, kwargs.get("replica"), kwargs.get("avoid"),
                    RecentPrefixes.keys(text) if text is not None else [], routed_id(path, body))
    if request.metadata.call_method == "info":
        return View(named=kwargs.get("replica"))
    if args and isinstance(args[0], bytes):  # Serve's proxy: a pickled StreamingHTTPRequest
        try:
            scope = pickle.loads(args[0]).asgi_scope
        except Exception:  # noqa: BLE001 -- not an HTTP request: route it by load
            return View()
        path = scope.get("path", "")
        keys, previous = header_hints(scope.get("headers", []))
        return View(path, keys=keys, some_id=routed_id(path) or previous)
    return View()


class CellserveRouter(RequestRouter):
    """Affinity by id, else longest reported prefix, else least loaded (Serve's queue lengths)."""

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """Give the replica to the very request it was chosen for (the hook `FIFOMixin` overrides too).

        Serve's default matches by internal request id, which calls made while handling one request share
        (the cluster deployment asks every replica at once): all but one of them would never be routed."""
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                self._record_queue_wait_time(pending)
                pending.future.set_result(replica)
                self._remove_pending_request_from_indices(pending)
                return

    def stats(self, replica: RunningReplica) -> dict:
        return replica.routing_stats or {}

    def holder(self, some_id: str, by_uid: dict[str, RunningReplica]) -> RunningReplica | None:
        """The live replica holding `some_id`: the one that made it, or the one reporting it moved there."""
        made_by = parse_id(some_id)
        if made_by in by_uid:
            return by_uid[made_by]
        for replica in by_uid.values():
            if some_id in self.stats(replica).get("held", ()):
                return replica
        return None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        view = request_view(pending_request) if pending_request is not None else View()
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # a full or missing choice: back off, retry
        by_uid = {r.replica_id.unique_id: r for r in candidate_replicas}
        if view.named is not None and view.named in by_uid:
            return [[by_uid[view.named]]]
        some_id = view.some_id if view.named is None else None
        if some_id is not None and (held := self.holder(some_id, by_uid)) is not None:
            return [[held]]
        # stateless, or an id no live replica holds (any replica answers that one 404, saying why)
        rest = [r for r in candidate_replicas if r.replica_id.unique_id != view.avoid] or candidate_replicas
        random.shuffle(rest)  # equal loads: spread, don't always pick the first
        rest.sort(key=lambda r: self.stats(r).get("load", 0))
        if view.keys:
            reported = {r.replica_id.unique_id: set(self.stats(r).get("prefixes", ())) for r in rest}
            hit = longest_match(view.keys, reported)
            if hit is not None:
                least = self.stats(rest[0]).get("load", 0)
                if self.stats(by_uid[hit]).get("load", 0) <= least + PREFIX_SLACK:
                    return [[by_uid[hit]], [r for r in rest if r is not by_uid[hit]]]
        return [rest]

"""What Serve's HTTP proxy tells the router about a request's body: a proxy middleware (`proxy_headers.middlewares`).

Serve's proxy routes a request before anything reads its body: the router sees the ASGI scope (method, path,
headers), and the replica pulls the body from the proxy afterwards. Prefix routing and a Responses request's
`previous_response_id` are in the body. This middleware, which runs in the proxy process ahead of Serve's own
handling, reads the body of a prompt-carrying `POST` (`PROMPT_PATHS`, at most `HINT_BODY_MAX` bytes by its
`Content-Length`), puts what the router needs in the scope's headers, and gives the proxy the body again:

- `x-cellserve-prefix`: the prompt's prefix keys (`routing.RecentPrefixes.keys`, comma-separated);
- `x-cellserve-route-id`: the stored response a `POST /v1/responses` continues (`previous_response_id`).

Any copy of these headers the client sent is dropped first: only the proxy sets them. A request it does not
read (another route, no or a larger `Content-Length`) goes on unchanged and is routed by load (the replica
still answers it right: `edge` hands a continuation on to its holder). Every answer also names the node
whose proxy gave it (`x-cellserve-proxy`), so a client or test can tell the proxies apart.
"""

from server.ray_serve.routing import RecentPrefixes, prompt_text, routed_id

PREFIX_HEADER = b"x-cellserve-prefix"
ROUTE_ID_HEADER = b"x-cellserve-route-id"
PROXY_HEADER = b"x-cellserve-proxy"
PROMPT_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/sequences", "/v1/responses")
HINT_BODY_MAX = 4 * 2**20  # a larger body (images) is not read in the proxy: routed by load
OURS = (PREFIX_HEADER, ROUTE_ID_HEADER)


def hints(path: str, body: bytes) -> list[tuple[bytes, bytes]]:
    """The routing headers for a request with this path and body (none when it has nothing to route by)."""
    out = []
    text = prompt_text(path, body)
    if text is not None and (keys := RecentPrefixes.keys(text)):
        out.append((PREFIX_HEADER, ",".join(keys).encode()))
    some_id = routed_id(path, body) if path == "/v1/responses" else None
    if some_id is not None and some_id.isascii() and some_id.isprintable():
        out.append((ROUTE_ID_HEADER, some_id.encode()))
    return out


def header_hints(headers) -> tuple[list[str], str | None]:
    """(prefix keys, route id) from a scope's headers, as the middleware set them (the router's side)."""
    keys, some_id = [], None
    for name, value in headers:
        if name == PREFIX_HEADER:
            keys = value.decode("ascii", "replace").split(",")
        elif name == ROUTE_ID_HEADER:
            some_id = value.decode("ascii", "replace")
    return keys, some_id


def content_length(headers) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def read_all(receive) -> tuple[bytes, list[dict]]:
    """The body, and every message received (to give the proxy again, a disconnect included)."""
    messages, chunks = [], []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks), messages


class RoutingHints:
    """ASGI middleware for Serve's proxy: routing headers from the body; the body itself is passed on intact."""

    def __init__(self, app):
        self.app = app
        self.node: bytes | None = None

    def node_id(self) -> bytes:
        if self.node is None:
            import ray

            # outside a Ray worker (no Ray started) there is no node to name; asking would start Ray
            self.node = ray.get_runtime_context().get_node_id().encode() if ray.is_initialized() else b"-"
        return self.node

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in OURS]
        size = content_length(headers)
        if scope["method"] == "POST" and scope["path"] in PROMPT_PATHS and size is not None and size <= HINT_BODY_MAX:
            body, messages = await read_all(receive)
            headers += hints(scope["path"], body)
            receive = replay_messages(messages, receive)
        node = self.node_id()

        async def named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (PROXY_HEADER, node)]}
            await send(message)

        await self.app({**scope, "headers": headers}, receive, named)


def replay_messages(messages: list[dict], receive):
    """A `receive` that gives `messages` again, then the client's own (its disconnect)."""
    pending = list(messages)

    async def again() -> dict:
        return pending.pop(0) if pending else await receive()

    return again

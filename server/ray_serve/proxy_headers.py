"""Serve's HTTP proxy keeps the app's `X-Request-ID`: a proxy middleware (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`).

Serve's proxy appends its own `X-Request-ID` to every answer (`RequestIdMiddleware`), after the one cellserve's
app sets to the response's id (which clients read, e.g. to cancel a stream). Two such headers would make the
id ambiguous; this middleware, which the proxy applies outside its own, drops the proxy's when the app already
sent one. Hand-written: Serve has no setting for it. `launch.start_ray` sets the variable for a local Ray;
a cluster started with `ray start` needs it in that command's environment (README, Scale-out).
"""

from starlette.middleware import Middleware

from server.ray_serve.proxy_routing import RoutingHints

REQUEST_ID = b"x-request-id"


class KeepAppRequestId:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def first_id_only(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                ids = [i for i, (k, _) in enumerate(headers) if k.lower() == REQUEST_ID]
                if len(ids) > 1:
                    message = {**message, "headers": [h for i, h in enumerate(headers) if i not in ids[1:]]}
            await send(message)

        await self.app(scope, receive, first_id_only)


def middlewares() -> list[Middleware]:
    """Every middleware of cellserve's for Serve's proxy (this one, and `proxy_routing.RoutingHints`)."""
    return [Middleware(KeepAppRequestId), Middleware(RoutingHints)]

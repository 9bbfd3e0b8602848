"""server/ray_serve/replica.py's run_asgi drives the app for one handle call: the app reads the body once, its
messages come back in order, and once the caller stops listening the app's next receive() says disconnect."""

import asyncio

from server.ray_serve.replica import run_asgi


def test_body_once_then_disconnect_when_the_caller_leaves():
    seen = []

    async def app(scope, receive, send):
        seen.append(await receive())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        seen.append(await receive())  # waits until the caller has left

    async def main():
        gen = run_asgi(app, {"type": "http"}, b"hello")
        first = [await gen.__anext__(), await gen.__anext__()]
        await gen.aclose()  # the caller stops listening
        await asyncio.sleep(0.05)
        return first

    first = asyncio.run(main())
    assert [m["type"] for m in first] == ["http.response.start", "http.response.body"]
    assert seen == [{"type": "http.request", "body": b"hello", "more_body": False}, {"type": "http.disconnect"}]

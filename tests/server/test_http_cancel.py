"""Cancel: by the endpoint and by dropping the connection (streaming and not); cells return to baseline
and other streams are untouched.

The design target is "cells back within a second"; the polls below allow more because this box's CPUs
are shared, and timings never decide a test. The elapsed time is printed for a human to read.
"""

import asyncio
import json
import time

import httpx
import pytest
from http_support import LONG_TOKENS, LiveServer, metric_value, sse_events

LONG = {"prompt": "ROMEO: But soft", "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}
SHORT = {"prompt": "JULIET: O Romeo", "max_tokens": 24, "temperature": 0}
POLL_S = 10.0
CANCELLED = "cellserve:request_success_total"


@pytest.fixture(scope="module")
def srv(long_model_dir):
    with LiveServer(long_model_dir, n_cells=8192) as server:
        yield server


def back_to(srv, baseline: int) -> None:
    t0 = time.monotonic()
    used = srv.wait_cells_used(baseline, timeout=POLL_S)
    print(f"cells back to baseline in {time.monotonic() - t0:.3f}s")
    assert used == baseline
    assert srv.wait_idle()["requests"] == {"running": 0, "waiting": 0}


def expected_short(srv) -> str:
    with srv.client() as c:
        return c.post("/v1/completions", json=SHORT).json()["choices"][0]["text"]


async def read_stream(client: httpx.AsyncClient, body: dict) -> list:
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        return sse_events([line async for line in resp.aiter_lines()])


def test_cancel_endpoint_mid_stream(srv):
    baseline = srv.cache()["cells"]["used"]
    want = expected_short(srv)

    async def main() -> tuple[list, list]:
        async with srv.async_client() as client:
            other = asyncio.create_task(read_stream(client, SHORT))
            async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
                rid = resp.headers["x-request-id"]
                events, cancelled = [], False
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    if len(events) == 3 and not cancelled:
                        r = await client.post(f"/v1/requests/{rid}/cancel")
                        assert r.status_code == 200 and r.json()["cancelled"] is True
                        cancelled = True
            return events, await other

    events, other = asyncio.run(main())
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "cancelled"
    assert len(events) < LONG["max_tokens"]
    assert "".join(e["choices"][0]["text"] for e in other[:-1]) == want  # the other stream is unaffected
    back_to(srv, baseline)
    with srv.client() as c:  # a finished request cannot be cancelled again
        assert c.post(f"/v1/requests/{events[0]['id']}/cancel").status_code == 404


def test_cancel_endpoint_for_a_non_streaming_request(srv):
    baseline = srv.cache()["cells"]["used"]

    async def main() -> dict:
        async with srv.async_client() as client:
            task = asyncio.create_task(client.post("/v1/completions", json=LONG))
            while not srv.cache()["requests"]["running"]:
                await asyncio.sleep(0.01)
            rid = next(iter(srv.ctx.runs))  # the id the response will carry
            assert (await client.post(f"/v1/requests/{rid}/cancel")).status_code == 200
            return (await task).json()

    body = asyncio.run(main())
    assert body["choices"][0]["finish_reason"] == "cancelled"
    assert body["usage"]["completion_tokens"] < LONG["max_tokens"]
    back_to(srv, baseline)


def cancelled(srv) -> float:
    return metric_value(srv, CANCELLED, finished_reason="cancelled")


def test_dropped_stream_frees_cells_and_spares_others(srv):
    baseline = srv.cache()["cells"]["used"]
    want = expected_short(srv)
    before = cancelled(srv)

    async def main() -> list:
        async with srv.async_client() as client:
            other = asyncio.create_task(read_stream(client, SHORT))
            async with srv.async_client() as dropper, \
                    dropper.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
                n = 0
                async for line in resp.aiter_lines():
                    n += line.startswith("data: {")
                    if n == 3:
                        break  # leaving both blocks closes the connection mid-stream
            return await other

    other = asyncio.run(main())
    assert "".join(e["choices"][0]["text"] for e in other[:-1]) == want
    back_to(srv, baseline)
    assert cancelled(srv) == before + 1


def test_dropped_non_streaming_request_is_cancelled(srv):
    baseline = srv.cache()["cells"]["used"]
    before = cancelled(srv)
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=srv.url, timeout=httpx.Timeout(60, read=0.3)) as c:
        c.post("/v1/completions", json=LONG)
    back_to(srv, baseline)
    assert cancelled(srv) == before + 1


def test_sequence_generation_cancel_keeps_the_sequence(srv):
    with srv.client() as c:
        seq = c.post("/v1/sequences", json={"prompt": "ROMEO:"}).json()
        used_idle = srv.cache()["cells"]["used"]
        body = {"max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}
        with c.stream("POST", f"/v1/sequences/{seq['id']}/completions", json=body) as resp:
            rid = resp.headers["x-request-id"]
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    assert httpx.post(f"{srv.url}/v1/requests/{rid}/cancel").status_code == 200
                    break
        srv.wait_idle()
        info = c.get(f"/v1/sequences/{seq['id']}").json()
        assert info["status"] == "idle" and seq["length"] < info["length"] < seq["length"] + LONG_TOKENS
        assert srv.cache()["cells"]["used"] >= used_idle  # its history (with what it generated) stays
        c.delete(f"/v1/sequences/{seq['id']}")

"""llama.cpp's resumable streams over a real server: a stream sent with `X-Conversation-Id` is replayed byte for
byte from any offset (`GET /v1/stream`), keeps generating when its client leaves (the replay then has the whole
answer, equal to the engine's greedy output), is stopped by `DELETE /v1/stream` (the generation is cancelled
and both its own stream and a replay end cleanly), and is found by `POST /v1/streams/lookup`; requests without
the header or without `stream` are untouched. The kept stream's own rules (cap, offsets, expiry, one live
kept stream per id) are checked directly."""

import asyncio
import time

import httpx
import pytest
from http_support import Greedy, LiveServer, sse_events

from server.streams.kept import KeptStreams, OffsetLost


@pytest.fixture(scope="module")
def srv(long_model_dir):
    with LiveServer(long_model_dir) as server:
        yield server


def _chat(max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, **extra}


def _text(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e != "[DONE]" and e["choices"])


def test_a_finished_stream_replays_byte_for_byte_then_a_stop_forgets_it(srv):
    head = {"X-Conversation-Id": "conv-1::org/model:Q8_0"}
    with srv.client() as c:
        with c.stream("POST", "/chat/completions", json=_chat(8), headers=head) as r:
            sent = r.read()
        replay = c.get("/v1/stream", params={"conv_id": "conv-1::org/model:Q8_0", "from": 0})
        assert replay.status_code == 200 and replay.headers["content-type"].startswith("text/event-stream")
        assert replay.content == sent and sent.endswith(b"data: [DONE]\n\n")
        tail = c.get("/v1/stream", params={"conv_id": "conv-1::org/model:Q8_0", "from": 10}).content
        assert tail == sent[10:]
        found = c.post("/v1/streams/lookup", json={"conversation_ids": ["conv-1", "nobody"]}).json()
        assert [(f["conversation_id"], f["is_done"], f["total_bytes"]) for f in found] == \
            [("conv-1::org/model:Q8_0", True, len(sent))]
        assert c.delete("/v1/stream", params={"conv_id": "conv-1::org/model:Q8_0"}).status_code == 204
        assert c.get("/v1/stream", params={"conv_id": "conv-1::org/model:Q8_0"}).status_code == 404
        assert c.delete("/v1/stream", params={"conv_id": "conv-1::org/model:Q8_0"}).status_code == 204  # idempotent
        assert c.get("/v1/stream").status_code == 400


def test_requests_that_do_not_stream_keep_no_kept_stream(srv):
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={**_chat(3), "stream": False}, headers={"X-Conversation-Id": "c2"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        bad = c.post("/v1/chat/completions", json=_chat(-1), headers={"X-Conversation-Id": "c3"})
        assert bad.status_code == 400
        for conv in ("c2", "c3"):
            assert c.get("/v1/stream", params={"conv_id": conv}).status_code == 404


def test_a_stream_outlives_its_client_and_the_replay_has_the_whole_answer(srv, long_model_dir):
    greedy = Greedy(long_model_dir)
    ids = greedy.tokenizer.apply_chat_template(_chat(1)["messages"], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    want = greedy(ids, 40).text
    with httpx.Client(base_url=srv.url, timeout=60) as c, \
            c.stream("POST", "/v1/chat/completions", json=_chat(40), headers={"X-Conversation-Id": "c4"}) as r:
        next(r.iter_lines())  # the first event arrived: the request runs; now the client leaves
    with srv.client() as c:
        events = sse_events(c.get("/v1/stream", params={"conv_id": "c4", "from": 0}).iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert _text(events) == want


def test_a_stop_cancels_the_generation_and_ends_both_streams(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c, httpx.Client(base_url=srv.url, timeout=60) as other, \
            c.stream("POST", "/v1/chat/completions", json=_chat(1500), headers={"X-Conversation-Id": "c5"}) as r:
        lines = r.iter_lines()
        next(lines)
        with other.stream("GET", "/v1/stream", params={"conv_id": "c5"}) as replay:
            assert replay.status_code == 200
            replayed = replay.iter_lines()
            next(replayed)
            assert other.delete("/v1/stream", params={"conv_id": "c5"}).status_code == 204
            rest = list(replayed)  # ends, cleanly
        events = sse_events(lines)
    assert all(e["choices"][0].get("finish_reason") is None for e in events if e != "[DONE]" and e["choices"])
    deadline = time.monotonic() + 30
    while srv.ctx.engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.ctx.engine.stats().running == 0
    assert "[DONE]" not in sse_events(rest)


def test_a_newer_stream_under_the_same_id_stops_the_older_one(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c, srv.client() as d:
        with c.stream("POST", "/v1/chat/completions", json=_chat(1500), headers={"X-Conversation-Id": "c6"}) as r:
            lines = r.iter_lines()
            next(lines)
            newer = d.post("/v1/chat/completions", json=_chat(4), headers={"X-Conversation-Id": "c6"})
            older = sse_events(lines)
        assert sse_events(newer.iter_lines())[-1] == "[DONE]" and "[DONE]" not in older
        assert d.get("/v1/stream", params={"conv_id": "c6"}).content == newer.content


def test_the_kept_stream_buffer_keeps_its_cap_its_offsets_and_its_expiry():
    async def run():
        streams = KeptStreams(ttl_s=0.2, max_bytes=8)
        first = streams.open("a")
        first.append(b"0123456789")  # over the cap: the oldest two bytes go
        assert first.dropped == 2 and first.total == 10
        with pytest.raises(OffsetLost):
            first.check_offset(1)
        reader = asyncio.ensure_future(_collect(first.read(4)))
        await asyncio.sleep(0)
        first.append(b"ab")
        await asyncio.sleep(0)
        first.finish()
        assert await reader == b"456789ab"
        second = streams.open("a")  # the one before under this id is stopped
        assert first.cancelled.is_set() and streams.get("a") is second
        assert [s.conversation_id for s in streams.lookup(["a", "b"])] == ["a"]
        second.finish()
        await asyncio.sleep(0.3)
        assert streams.get("a") is None

    asyncio.run(run())


async def _collect(chunks) -> bytes:
    return b"".join([c async for c in chunks])

"""The multi-turn chat workload of `cellserve bench serve` against a tiny fake chat server.

The fake (FastAPI + uvicorn on 127.0.0.1, free port, background thread) answers every
/v1/chat/completions stream with a reply that names the turn it saw, and reports usage with
`prompt_tokens` = words of all messages and `cached_tokens` = words of all but the last message
(a perfect prefix cache). With `"fail_turn": k` in the body (sent through --extra-body) it answers
500 at turn k. No assertion depends on timings.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.bench.multiturn import MultiTurnWorkload, turn_stats
from server.bench.records import RequestRecord
from server.bench.serve import main


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _words(messages: list[dict]) -> int:
    return sum(len(m["content"].split()) for m in messages)


def build_app(bodies: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-chat", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        bodies.append(body)
        messages = body["messages"]
        turn = sum(m["role"] == "user" for m in messages)
        if body.get("fail_turn") == turn:
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        usage = {"prompt_tokens": _words(messages), "completion_tokens": 3, "total_tokens": _words(messages) + 3,
                 "prompt_tokens_details": {"cached_tokens": _words(messages[:-1])}}

        async def stream():
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for piece in ("answer", f" to turn {turn}", "."):
                yield _sse({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
            yield _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            yield _sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def chat_server():
    bodies: list[dict] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(bodies), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "fake chat server did not start within 30 s"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", bodies
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def _run(url: str, tmp_path, *extra: str) -> dict:
    out = tmp_path / "mt.json"
    argv = ["--url", url, "--workload", "multi-turn", "--turns", "4", "--num-requests", "3",
            "--concurrency", "2", "--input-len", "5", "--output-len", "3", "--no-progress",
            "--out", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_each_turn_resends_the_growing_history(chat_server, tmp_path, capsys):
    url, bodies = chat_server
    bodies.clear()
    data = _run(url, tmp_path, "--system-len", "7")
    assert len(bodies) == 3 * 4
    convs: dict[str, list[list[dict]]] = {}
    for body in bodies:
        assert body["stream"] is True and body["max_tokens"] == 3
        convs.setdefault(body["messages"][0]["content"], []).append(body["messages"])
    assert len(convs) == 3
    for turns in convs.values():
        assert [len(m) for m in turns] == [2, 4, 6, 8]  # system + (user, assistant) per earlier turn + user
        for k in range(1, 4):
            prev, cur = turns[k - 1], turns[k]
            assert cur[:len(prev)] == prev  # the earlier messages, unchanged
            assert cur[len(prev)] == {"role": "assistant", "content": f"answer to turn {k}."}
            assert cur[-1]["role"] == "user" and cur[-1]["content"] not in [m["content"] for m in prev]
        assert turns[0][0]["role"] == "system" and len(turns[0][0]["content"].split()) == 2 + 7
    out = capsys.readouterr().out
    assert "TTFT by turn" in out
    level = data["levels"][0]
    assert [t["turn"] for t in level["turns"]] == [1, 2, 3, 4]
    assert all(t["count"] == 3 and t["ttft"]["count"] == 3 for t in level["turns"])
    # the fake's usage: prompt = every message's words, cached = all but the new user message
    assert level["turns"][0]["cached_tokens"] == 9
    prompt = [t["prompt_tokens"] for t in level["turns"]]
    assert prompt == sorted(prompt) and prompt[0] < prompt[-1]
    recs = [r for r in level["records"] if r["turn"] == 4]
    assert all(r["prompt_tokens"] - r["cached_tokens"] == 5 for r in recs)
    assert level["summary"]["completed"] == 12


def test_a_failed_turn_ends_its_conversation(chat_server, tmp_path):
    url, bodies = chat_server
    bodies.clear()
    data = _run(url, tmp_path, "--extra-body", '{"fail_turn": 3}')
    level = data["levels"][0]
    assert len(bodies) == 3 * 3  # turns 1, 2 and the failed 3; turn 4 is never sent
    assert level["summary"]["completed"] == 6 and level["summary"]["errors"] == {"500": 3}
    assert [t["turn"] for t in level["turns"]] == [1, 2]


def test_turn_stats_and_workload_plan():
    plan = MultiTurnWorkload(turns=6, input_len=10, output_len=4, seed=1).conversation(0)
    assert len(plan.users) == 6 and plan.max_tokens == [4] * 6 and plan.system is None
    assert plan == MultiTurnWorkload(turns=6, input_len=10, output_len=4, seed=1).conversation(0)
    recs = [RequestRecord(index=i, kind="turn", turn=t, ttft=0.01 * t, prompt_tokens=10 * t, cached_tokens=None)
            for i in range(2) for t in (1, 2)]
    recs.append(RequestRecord(index=9, kind="turn", turn=2, error="500"))
    stats = turn_stats(recs)
    assert [(s.turn, s.count, s.prompt_tokens, s.cached_tokens) for s in stats] == [(1, 2, 10, None),
                                                                                     (2, 2, 20, None)]
    assert stats[1].ttft.p50 == pytest.approx(20.0)
    with pytest.raises(ValueError, match="--turns"):
        MultiTurnWorkload(turns=0)

"""Tests of the `cellserve bench serve` load generator (server/bench), client side only.

The end-to-end tests run the real CLI entry point against a tiny fake OpenAI-compatible SSE server
defined below (FastAPI + uvicorn on 127.0.0.1, free port, background thread). The fake fails some
requests on purpose, by arrival order: number n (counted per app) gets 429 when n % 10 in (4, 9)
and a mid-stream `data: {"error": ...}` event when n % 10 == 3, so every 10 requests give 7 OK,
2 x 429 and 1 x sse_error whatever the concurrency. Every successful stream carries TOKENS tokens.
No assertion depends on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.bench.arrivals import arrival_times, inter_arrival_gaps
from server.bench.copying import CopyWorkload
from server.bench.metrics import Slo, parse_slo, percentile, summarize
from server.bench.records import RequestRecord
from server.bench.serve import add_parser, main, main_with_subcommand
from server.bench.sse import SseDecoder
from server.bench.workloads import RandomWorkload, SharedPrefixWorkload

TOKENS = 6
TOKEN_DELAY = 0.002
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- fake OpenAI-compatible server


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class FakeState:
    """What the fake saw: request bodies, the arrival counter, live sequences."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.bodies: list[dict] = []
        self.seq_bodies: list[tuple[str, dict]] = []
        self.sequences: dict[str, str] = {}
        self.next_seq = 0
        self.forks = 0


async def _token_stream(kind: str, fail_mid: bool, usage: dict | None):
    if kind == "chat":
        yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    for i in range(TOKENS):
        await asyncio.sleep(TOKEN_DELAY)
        if fail_mid and i == 2:
            yield _sse({"error": {"message": "boom", "type": "server_error", "code": 500}})
            yield "data: [DONE]\n\n"
            return
        piece = f" t{i}"
        choice = {"index": 0, "delta": {"content": piece}} if kind == "chat" else {"index": 0, "text": piece}
        yield _sse({"choices": [{**choice, "finish_reason": None}]})
    last = {"index": 0, "delta": {}} if kind == "chat" else {"index": 0, "text": ""}
    yield _sse({"choices": [{**last, "finish_reason": "length"}]})
    if usage is not None:
        yield _sse({"choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _usage(body: dict, prompt_tokens: int) -> dict | None:
    if not (body.get("stream_options") or {}).get("include_usage"):
        return None
    return {"prompt_tokens": prompt_tokens, "completion_tokens": TOKENS, "total_tokens": prompt_tokens + TOKENS}


def _openai_reply(state: FakeState, body: dict, kind: str, usage: dict | None):
    n = state.count
    state.count += 1
    state.bodies.append(body)
    if n % 10 in (4, 9):
        err = {"error": {"message": "queue full", "type": "rate_limit", "param": None, "code": 429}}
        return JSONResponse(err, status_code=429, headers={"Retry-After": "1"})
    stream = _token_stream(kind, fail_mid=n % 10 == 3, usage=usage)
    return StreamingResponse(stream, media_type="text/event-stream")


def _add_openai_routes(app: FastAPI, state: FakeState) -> None:
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        return _openai_reply(state, body, "text", _usage(body, len(body["prompt"].split())))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()  # no usage from this endpoint: the client falls back to chunks
        return _openai_reply(state, body, "chat", None)


def _add_sequence_routes(app: FastAPI, state: FakeState) -> None:
    def new_id(text: str) -> str:
        state.next_seq += 1
        sid = f"seq-{state.next_seq}"
        state.sequences[sid] = text
        return sid

    @app.post("/v1/sequences")
    async def create(request: Request):
        return {"id": new_id((await request.json())["prompt"])}

    @app.post("/v1/sequences/{sid}/fork")
    async def fork(sid: str):
        if sid not in state.sequences:
            return JSONResponse({"error": {"message": "no such sequence"}}, status_code=404)
        state.forks += 1
        return {"id": new_id(state.sequences[sid])}

    @app.post("/v1/sequences/{sid}/completions")
    async def seq_completions(sid: str, request: Request):
        body = await request.json()
        state.seq_bodies.append((sid, body))
        state.sequences[sid] += body.get("prompt", "")
        stream = _token_stream("text", fail_mid=False, usage=_usage(body, len(state.sequences[sid].split())))
        return StreamingResponse(stream, media_type="text/event-stream")

    @app.delete("/v1/sequences/{sid}")
    async def delete(sid: str):
        if state.sequences.pop(sid, None) is None:
            return JSONResponse({"error": {"message": "no such sequence"}}, status_code=404)
        return {"id": sid, "deleted": True}


def build_fake_app(with_sequences: bool) -> tuple[FastAPI, FakeState]:
    app, state = FastAPI(), FakeState()
    _add_openai_routes(app, state)
    if with_sequences:
        _add_sequence_routes(app, state)
    return app, state


class FakeServer:
    """The full fake at `url` (with /v1/sequences) and a plain one at `url + '/plain'` (without)."""

    def __init__(self) -> None:
        self.app, self.state = build_fake_app(with_sequences=True)
        plain_app, self.plain_state = build_fake_app(with_sequences=False)
        self.app.mount("/plain", plain_app)
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say so, and without
        # it Nagle + delayed ACKs hold each stream's first chunk back by ~40 ms.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "fake server did not start within 30 s"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def fake():
    server = FakeServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def fresh(fake):
    fake.state.reset()
    fake.plain_state.reset()
    return fake


# ---------------------------------------------------------------- metrics on known records


def _rec(i, chunks=(), latency=None, tokens=None, error=None, prompt_tokens=None):
    rec = RequestRecord(index=i, chunk_times=list(chunks), latency=latency, prompt_tokens=prompt_tokens)
    rec.ttft = chunks[0] if chunks else None
    rec.output_tokens = len(chunks) if tokens is None else tokens
    if error:
        rec.fail(error, "synthetic")
    return rec


def _synthetic_records() -> list[RequestRecord]:
    return [
        _rec(0, [0.10, 0.15, 0.22, 0.30], latency=0.35, prompt_tokens=10),
        _rec(1, [0.20, 0.26, 0.31], latency=0.40, prompt_tokens=12),
        _rec(2, [0.05], latency=0.06, prompt_tokens=7),
        _rec(3, [0.30, 0.50, 0.90, 1.00], latency=1.20, tokens=5, prompt_tokens=9),
        _rec(4, latency=0.01, error="429"),
        _rec(5, latency=0.02, error="429"),
        _rec(6, [0.1, 0.2], latency=0.3, error="sse_error"),
        _rec(7, error="timeout"),
    ]


def _expected_dist(values_s):
    ms = np.array(values_s) * 1000.0
    return {"count": len(ms), "mean": statistics.mean(ms.tolist()),
            **{f"p{q}": float(np.percentile(ms, q)) for q in (50, 90, 99)}}


def _assert_dist(dist, expected):
    assert dist.count == expected["count"]
    for key in ("mean", "p50", "p90", "p99"):
        assert getattr(dist, key) == pytest.approx(expected[key], rel=1e-12, abs=1e-9), key


def test_summary_matches_independent_computation():
    records = _synthetic_records()
    s = summarize(records, duration_s=2.0, slo=Slo(ttft=250, tpot=90))
    ok = records[:4]
    assert (s.requests, s.completed, s.failed) == (8, 4, 4)
    assert s.errors == {"429": 2, "sse_error": 1, "timeout": 1}
    assert s.total_output_tokens == 4 + 3 + 1 + 5
    assert s.request_throughput == pytest.approx(4 / 2.0)
    assert s.output_throughput == pytest.approx(13 / 2.0)
    assert s.total_prompt_tokens == 38
    assert s.concurrency_achieved == pytest.approx((0.35 + 0.40 + 0.06 + 1.20) / 2.0)
    _assert_dist(s.ttft, _expected_dist([0.10, 0.20, 0.05, 0.30]))
    _assert_dist(s.e2el, _expected_dist([0.35, 0.40, 0.06, 1.20]))
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    assert len(tpots) == 3  # the 1-token request has no TPOT
    _assert_dist(s.tpot, _expected_dist(tpots))
    gaps = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    assert len(gaps) == 3 + 2 + 0 + 3
    _assert_dist(s.itl, _expected_dist(gaps))
    # SLO ttft<=250ms, tpot<=90ms: r0 meets both, r1 has TPOT 100ms, r2 has no TPOT, r3 has TTFT 300ms.
    assert s.slo_met == 2
    assert s.goodput == pytest.approx(2 / 2.0)
    assert s.fork.count == 0 and s.fork.mean is None


def test_summary_without_slo_or_successes():
    s = summarize([_rec(0, latency=0.1, error="503")], duration_s=1.0)
    assert s.goodput is None and s.slo_met is None
    assert s.completed == 0 and s.errors == {"503": 1}
    assert s.ttft.count == 0 and s.ttft.p99 is None
    assert s.total_prompt_tokens is None
    partial = summarize([_rec(0, [0.1], latency=0.2, prompt_tokens=3), _rec(1, [0.1], latency=0.2)], 1.0)
    assert partial.total_prompt_tokens is None  # unknown for one request: no misleading partial sum


def test_percentile_matches_numpy():
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101):
        values = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)


def test_parse_slo():
    assert parse_slo("ttft=500,tpot=50") == Slo(ttft=500, tpot=50)
    assert parse_slo("ttft:500 e2el:3000") == Slo(ttft=500, e2el=3000)
    for bad in ("ttft", "speed=3", "ttft=abc", "ttft=-1", ""):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_record_round_trip():
    rec = _synthetic_records()[0]
    assert RequestRecord.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec


# ---------------------------------------------------------------- arrivals, SSE, workloads


def test_poisson_arrivals_are_seeded_and_have_the_right_mean():
    gaps = inter_arrival_gaps(rate=4.0, burstiness=1.0, seed=11)
    sample = [next(gaps) for _ in range(20000)]
    again = inter_arrival_gaps(rate=4.0, burstiness=1.0, seed=11)
    assert sample == [next(again) for _ in range(20000)]
    other = inter_arrival_gaps(rate=4.0, burstiness=1.0, seed=12)
    assert sample[:50] != [next(other) for _ in range(50)]
    assert statistics.mean(sample) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(sample) == pytest.approx(0.25, rel=0.05)  # exponential: stdev == mean
    bursty = inter_arrival_gaps(rate=4.0, burstiness=0.25, seed=11)
    bursty_sample = [next(bursty) for _ in range(20000)]
    assert statistics.mean(bursty_sample) == pytest.approx(0.25, rel=0.06)
    assert statistics.stdev(bursty_sample) > 1.5 * statistics.stdev(sample)  # gamma shape 1/4: cv = 2
    times = arrival_times(rate=4.0, n=100, seed=11)
    assert times == sorted(times) and times[0] == sample[0]
    assert arrival_times(rate=math.inf, n=5) == [0.0] * 5
    with pytest.raises(ValueError, match="request-rate"):
        next(inter_arrival_gaps(rate=0.0))


def test_sse_decoder():
    dec = SseDecoder()
    lines = [": keep-alive", 'data: {"choices": [{"text": "a"}]}', "", "event: x", "data: {\"a\":", 'data: 1}',
             "", 'data: {"error": {"message": "bad"}}', "", "data: [DONE]"]
    events = [e for line in lines for e in dec.feed(line)] + dec.flush()
    assert len(events) == 4
    assert events[0].data == {"choices": [{"text": "a"}]} and events[0].error is None
    assert events[1].data == {"a": 1}  # two data lines form one event
    assert events[2].error == {"message": "bad"}
    assert events[3].done


def test_workloads_are_deterministic_and_shaped():
    wl = RandomWorkload(input_len=40, output_len=10, range_ratio=0.5, seed=3)
    prompts = [wl.prompt(i) for i in range(50)]
    assert prompts == [RandomWorkload(input_len=40, output_len=10, range_ratio=0.5, seed=3).prompt(i)
                       for i in range(50)]
    assert all(20 <= p.words <= 60 and len(p.user.split()) == p.words for p in prompts)
    assert all(5 <= p.max_tokens <= 15 for p in prompts)
    assert len({p.user for p in prompts}) == 50
    sp = SharedPrefixWorkload(num_groups=3, prefix_len=30, input_len=5, output_len=4, seed=1)
    a, b, c = sp.prompt(0), sp.prompt(3), sp.prompt(1)
    assert a.system == b.system != c.system and a.group == b.group == 0 and c.group == 1
    assert a.as_text().startswith(a.system) and a.as_messages()[0] == {"role": "system", "content": a.system}
    with pytest.raises(ValueError, match="range-ratio"):
        RandomWorkload(range_ratio=1.0)


def test_copy_workloads_repeat_their_prompt_and_vary():
    edit = [CopyWorkload(kind="edit", input_len=40, output_len=99, seed=2).prompt(i) for i in range(5)]
    assert edit == [CopyWorkload(kind="edit", input_len=40, output_len=99, seed=2).prompt(i) for i in range(5)]
    assert len({p.user for p in edit}) == 5 and all(p.max_tokens == 99 for p in edit)
    for p in edit:  # the function named in the instruction is defined and called in the code
        name = p.user.split("`")[1]
        code = p.user.split("```python\n")[1]
        assert f"def {name}(" in code and f"{name}(1, 2)" in code and len(code.split()) >= 40
        compile(code.rstrip("`"), "<edit>", "exec")
    quote = CopyWorkload(kind="quote", input_len=50, seed=2).prompt(0)
    text = quote.user.split("\n\n", 1)[1]
    assert quote.user.startswith("Repeat the following passage") and len(text.split()) >= 50
    with pytest.raises(ValueError, match="edit, quote, summarise"):
        CopyWorkload(kind="summary")


# ---------------------------------------------------------------- end to end against the fake


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_closed_loop_sweep_against_fake_server(fresh, tmp_path, capsys):
    out, plots = tmp_path / "res.json", tmp_path / "plots"
    rc = main(["--url", fresh.url, "--concurrency", "1,4", "--num-requests", "20", "--input-len", "12",
               "--output-len", str(TOKENS), "--ignore-eos", "--slo", "ttft=60000,tpot=60000",
               "--out", str(out), "--plot", str(plots), "--seed", "5"])
    assert rc == 0
    data = _load(out)
    assert data["config"]["model"] == "fake-model"  # from GET /v1/models
    assert data["command"].startswith("cellserve bench serve --url")
    assert data["machine"]["cpu_count"] >= 1
    assert [lv["level"]["concurrency"] for lv in data["levels"]] == [1, 4]
    for lv in data["levels"]:
        s = lv["summary"]
        assert (s["requests"], s["completed"], s["failed"]) == (20, 14, 6)
        assert s["errors"] == {"429": 4, "sse_error": 2}
        assert s["total_output_tokens"] == 14 * TOKENS
        assert s["itl"]["count"] == 14 * (TOKENS - 1) and s["tpot"]["count"] == 14
        assert s["slo_met"] == 14 and s["goodput"] > 0
        recs = [RequestRecord.from_dict(r) for r in lv["records"]]
        assert sorted(r.index for r in recs) == list(range(20))
        for r in recs:
            if r.ok:
                assert r.usage_reported and r.output_tokens == TOKENS == len(r.chunk_times)
                assert r.prompt_tokens == 12 and 0 < r.ttft <= r.latency
            elif r.error == "429":
                assert r.status == 429 and "queue full" in r.error_message
            else:
                assert r.error == "sse_error" and "boom" in r.error_message
    assert len(fresh.state.bodies) == 40
    body = fresh.state.bodies[0]
    assert body["model"] == "fake-model" and body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == TOKENS and body["temperature"] == 0
    for name in ("throughput.png", "ttft_cdf.png", "e2el_cdf.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "concurrency=4" in printed and "==== sweep ====" in printed and "429: 4" in printed


def test_open_loop_chat_shared_prefix(fresh, tmp_path):
    out = tmp_path / "chat.json"
    rc = main(["--url", fresh.url, "--endpoint", "chat", "--model", "given-model", "--request-rate", "200",
               "--num-requests", "10", "--workload", "shared-prefix", "--num-groups", "2", "--prefix-len", "20",
               "--input-len", "4", "--output-len", "3", "--api-key", "k", "--out", str(out), "--no-progress"])
    assert rc == 0
    lv = _load(out)["levels"][0]
    assert lv["level"]["mode"] == "open" and lv["level"]["request_rate"] == 200
    s = lv["summary"]
    assert (s["completed"], s["errors"]) == (7, {"429": 2, "sse_error": 1})
    recs = [RequestRecord.from_dict(r) for r in lv["records"]]
    # No usage on this endpoint: tokens are counted from content chunks (the role-only chunk is not one).
    assert all(r.output_tokens == TOKENS and not r.usage_reported for r in recs if r.ok)
    assert s["total_output_tokens"] == 7 * TOKENS
    bodies = fresh.state.bodies
    assert all(b["model"] == "given-model" and b["max_tokens"] == 3 for b in bodies)
    systems = {b["messages"][0]["content"] for b in bodies}
    assert len(systems) == 2 and all(b["messages"][0]["role"] == "system" for b in bodies)
    assert "k" not in json.dumps(_load(out)["config"]["args"].get("api_key", ""))


def test_fork_tree_against_fake_sequences(fresh, tmp_path):
    out = tmp_path / "tree.json"
    rc = main(["--url", fresh.url, "--workload", "fork-tree", "--branches", "3", "--num-requests", "4",
               "--concurrency", "2", "--input-len", "8", "--branch-len", "2", "--output-len", "5",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    s = _load(out)["levels"][0]["summary"]
    recs = [RequestRecord.from_dict(r) for r in _load(out)["levels"][0]["records"]]
    assert (s["requests"], s["completed"], s["failed"]) == (16, 16, 0)
    assert sorted(r.kind for r in recs) == ["branch"] * 12 + ["trunk"] * 4
    assert s["fork"]["count"] == 12 and s["cleanup_failures"] == 0
    assert s["total_output_tokens"] == 16 * TOKENS
    assert fresh.state.forks == 12
    assert fresh.state.sequences == {}  # every trunk, branch and the probe were deleted
    trunk_bodies = [b for _, b in fresh.state.seq_bodies if "prompt" not in b]
    branch_bodies = [b for _, b in fresh.state.seq_bodies if "prompt" in b]
    assert len(trunk_bodies) == 4 and len(branch_bodies) == 12
    assert all(b["stream"] is True and b["max_tokens"] == 5 for _, b in fresh.state.seq_bodies)


def test_fork_tree_is_skipped_without_sequences_api(fresh, tmp_path, capsys):
    out = tmp_path / "skip.json"
    rc = main(["--url", fresh.url + "/plain", "--workload", "fork-tree", "--num-requests", "3",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    lv = _load(out)["levels"][0]
    assert "404" in lv["skipped"] and lv["summary"] is None and lv["records"] == []
    assert fresh.plain_state.count == 0
    assert "skipped" in capsys.readouterr().out


def test_duration_bounds_a_closed_loop_run(fresh, tmp_path):
    out = tmp_path / "dur.json"
    rc = main(["--url", fresh.url, "--duration", "0.3", "--concurrency", "2", "--output-len", "2",
               "--input-len", "3", "--out", str(out)])
    assert rc == 0
    lv = _load(out)["levels"][0]
    assert lv["level"]["num_requests"] is None and lv["level"]["duration"] == 0.3
    assert lv["summary"]["requests"] == len(lv["records"]) == fresh.state.count >= 1


def test_lora_ids_alternate_llama_cpp_adapter_ids_by_request(fresh, tmp_path):
    """--lora-ids 3: request i carries llama.cpp's `lora: [{"id": i % 3, "scale": 1.0}]` (the adapter side-by-side)."""
    rc = main(["--url", fresh.url, "--concurrency", "1", "--num-requests", "7", "--input-len", "3",
               "--output-len", "2", "--lora-ids", "3", "--out", str(tmp_path / "l.json")])
    assert rc == 0
    assert [b["lora"] for b in fresh.state.bodies] == [[{"id": i % 3, "scale": 1.0}] for i in range(7)]


def test_unreachable_server_and_usage_errors(tmp_path, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["--url", f"http://127.0.0.1:{port}", "--num-requests", "1", "--no-progress"]) == 1
    assert "cannot reach" in capsys.readouterr().err
    for argv in (["--slo", "fast"], ["--request-rate", "inf", "--duration", "5"],
                 ["--request-rate", "1,2", "--concurrency", "1,2"], ["--concurrency", "0"],
                 ["--extra-body", "[1]"], ["--range-ratio", "2"], ["--endpoint", "nope"],
                 ["--workload", "quote"]):  # a copy workload needs --endpoint chat
        assert main(["--url", "http://127.0.0.1:9", *argv]) == 2, argv
    assert main_with_subcommand(["run"]) == 2
    assert main_with_subcommand(["serve", "--help"]) == 0
    assert "--request-rate" in capsys.readouterr().out


def test_add_parser_registers_serve():
    parser = argparse.ArgumentParser(prog="cellserve")
    bench = parser.add_subparsers(dest="bench_cmd")
    add_parser(bench)
    args = parser.parse_args(["serve", "--concurrency", "1,2", "--workload", "fork-tree"])
    assert callable(args.func) and args.concurrency == "1,2" and args.workload == "fork-tree"


def test_bench_package_does_not_import_torch():
    code = ("import sys, server.bench.serve, server.bench.plots; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'engine'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)

"""Hostile but ordinary clients against a real server (issue #16): nothing a request does kills the
engine; limits are checked before any expensive work; text is validated at the edge; auth covers the
docs; no redirects; HEAD works; a create nobody waits for leaves nothing behind; a dead engine loop
turns /health to 503 and the process exits non-zero."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from http_support import API_KEY, LiveServer
from soak_support import free_port

from server.limits import Limits

OK = {"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def srv(model_dir):
    limits = Limits(max_body_bytes=64 * 1024, max_prompts=8, max_choices=32)
    with LiveServer(model_dir, n_cells=8192, limits=limits) as server:
        yield server


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def still_serves(srv: LiveServer) -> None:
    """The engine answers, the pool is back to empty, nothing runs, /health is 200."""
    body = srv.wait_idle(30)
    assert body["requests"] == {"running": 0, "waiting": 0}
    assert srv.wait_cells_used(0, timeout=10) == 0
    with srv.client() as c:
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json=OK).raise_for_status().json()["choices"][0]["finish_reason"]


def send_and_close(port: int, path: str, body: dict, after_s: float) -> None:
    """A client that sends a whole POST and closes its socket `after_s` later, reading nothing."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(after_s)


# ----- the engine survives clients that leave ----------------------------------------------------
def test_forty_early_disconnects_leave_the_engine_serving(srv):
    bodies = [("/v1/completions", {"prompt": "ROMEO:", "max_tokens": 30}),
              ("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 30, "stream": True}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30})]
    for i in range(40):
        path, body = bodies[i % 3]
        send_and_close(srv.port, path, body, after_s=(i % 6) * 0.01)
    still_serves(srv)
    assert not srv.fatal


def test_the_heavy_request_that_killed_the_engine(model_dir):
    """The issue's exact request, with a client that gives up after 3 s: refused before any work
    under the default limits; with limits opened up so that it is admitted, the client's leaving
    cancels it and the engine lives on."""
    heavy = {"prompt": [f"w{i}" for i in range(1000)], "n": 64, "max_tokens": 1}
    with LiveServer(model_dir, n_cells=8192) as default:
        with default.client() as c:
            assert error_of(c.post("/v1/completions", json=heavy), 400)["code"] == "too_many_prompts"
        still_serves(default)
    wide = Limits(max_prompts=1000, max_choices=64000)
    with LiveServer(model_dir, n_cells=70000, max_num_seqs=256, limits=wide) as open_srv:
        with httpx.Client(base_url=open_srv.url, timeout=3) as c, pytest.raises(httpx.TimeoutException):
            c.post("/v1/completions", json=heavy)
        still_serves(open_srv)
        assert not open_srv.fatal


def test_a_create_whose_client_left_is_rolled_back(long_model_dir):
    """A long prefill in small chunks: the client is gone long before it ends, so no sequence (and no
    cell) may be left for an id nobody received."""
    with LiveServer(long_model_dir, n_cells=8192, max_num_batched_tokens=16) as srv:
        send_and_close(srv.port, "/v1/sequences", {"prompt": list(range(3, 3003))}, after_s=0.05)
        deadline = time.monotonic() + 30
        with srv.client() as c:
            while c.get("/v1/sequences").json()["data"] or srv.cache()["cells"]["used"]:
                assert time.monotonic() < deadline, c.get("/v1/sequences").json()
                time.sleep(0.05)


# ----- limits before work ----------------------------------------------------------------------
def test_a_body_over_the_limit_is_413_unread(srv):
    big = json.dumps({"prompt": "x" * 70_000}).encode()
    with srv.client() as c:
        err = error_of(c.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}), 413)
        assert err["code"] == "body_too_large" and "65536" in err["message"]

        def chunks():  # no Content-Length: the limit is enforced on the bytes as they arrive
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"y" * 8192
            yield b'"}'

        err = error_of(c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}),
                       413)
        assert err["code"] == "body_too_large"
    still_serves(srv)


def test_prompt_and_choice_counts_are_refused_before_tokenization(srv):
    with srv.client() as c:
        err = error_of(c.post("/v1/completions", json={"prompt": ["a"] * 9, "max_tokens": 1}), 400)
        assert (err["param"], err["code"]) == ("prompt", "too_many_prompts")
        err = error_of(c.post("/v1/completions", json={"prompt": ["a"] * 4, "n": 9, "max_tokens": 1}), 400)
        assert (err["param"], err["code"]) == ("n", "too_many_choices")
        err = error_of(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                             "n": 33, "max_tokens": 1}), 400)
        assert err["param"] in ("n", None)


def test_text_that_cannot_fit_is_refused_before_tokenization(srv):
    text = "word " * 12000  # 48k non-whitespace characters: more than 512 tokens x the longest token
    with srv.client() as c:
        for path, body, param in [("/v1/completions", {"prompt": text}, "prompt"),
                                  ("/tokenize", {"prompt": text}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]},
                                   "messages"),
                                  ("/v1/sequences", {"prompt": text}, "prompt")]:
            err = error_of(c.post(path, json=body), 400)
            assert (err["code"], err["param"]) == ("context_length_exceeded", param), path


def test_prompts_times_n_over_the_pool_is_400_without_preempting(model_dir):
    with LiveServer(model_dir, n_cells=8192, limits=Limits(max_choices=4096)) as srv, srv.client() as c:
        before = srv.cache()["preemptions"]
        err = error_of(c.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"], "n": 64, "max_tokens": 100}),
                       400)
        assert err["code"] == "context_length_exceeded" and "8192" in err["message"]
        assert srv.cache()["preemptions"] == before
        still_serves(srv)


def test_stop_strings_are_capped(srv):
    with srv.client() as c:
        err = error_of(c.post("/v1/completions", json={**OK, "stop": [f"s{i}" for i in range(17)]}), 400)
        assert err["param"] == "stop" and "16" in err["message"]
        err = error_of(c.post("/v1/completions", json={**OK, "stop": ["z" * 257]}), 400)
        assert err["param"] == "stop"
        plain = c.post("/v1/completions", json={**OK, "max_tokens": 8}).json()["choices"][0]["text"]
        capped = c.post("/v1/completions", json={**OK, "max_tokens": 8, "n": 2,
                                                  "stop": [f"never{i}" * 30 for i in range(16)]}).json()
        assert [ch["text"] for ch in capped["choices"]] == [plain, plain]


# ----- text at the edge --------------------------------------------------------------------------
@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt[0]"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt[1]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/sequences", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}', "stop[0]"),
])
def test_lone_surrogates_are_400_naming_the_field(srv, path, raw, param):
    with srv.client() as c:
        err = error_of(c.post(path, content=raw.encode(), headers={"Content-Type": "application/json"}), 400)
        assert "surrogate" in err["message"]
        assert err["param"] in (param, param.split("[")[0]), err


def test_lone_surrogate_in_a_sequence_continuation(srv):
    with srv.client() as c:
        seq = c.post("/v1/sequences", json={"prompt": "ROMEO:"}).raise_for_status().json()
        r = c.post(f"/v1/sequences/{seq['id']}/completions", content=b'{"prompt": "\\ud800"}',
                   headers={"Content-Type": "application/json"})
        assert "surrogate" in error_of(r, 400)["message"]
        assert c.get(f"/v1/sequences/{seq['id']}").json()["length"] == seq["length"]  # unchanged
        c.delete(f"/v1/sequences/{seq['id']}")


# ----- routes, methods, auth ---------------------------------------------------------------------
def test_head_works_where_get_does_and_options_is_405(srv):
    with srv.client() as c:
        for path in ("/health", "/v1/models", "/v1/cache", "/metrics"):
            r = c.head(path)
            assert r.status_code == 200 and r.content == b"", path
        err = error_of(c.options("/v1/completions"), 405)
        assert err["code"] == "method_not_allowed"


def test_trailing_slashes_are_not_redirected(srv):
    with srv.client() as c:
        r = c.get("/v1/models/", headers={"Host": "evil.example"})
        assert r.status_code == 404 and "location" not in r.headers
        assert r.json()["error"]["code"] == "not_found"


def test_api_key_covers_the_docs(model_dir):
    with LiveServer(model_dir, n_cells=256, api_key=API_KEY) as srv, httpx.Client(base_url=srv.url) as anon:
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect", "/openapi.json"):
            assert anon.get(path).status_code == 404, path
        assert anon.get("/v1/models").status_code == 401
        assert anon.head("/v1/models").status_code == 401
        assert anon.get("/health").status_code == 200 and anon.head("/health").status_code == 200
        assert anon.get("/v1/models/", headers={"Host": "evil.example"}).headers.get("location") is None


def test_docs_are_served_without_a_key(srv):
    with srv.client() as c:
        assert c.get("/docs").status_code == 200
        assert "/v1/completions" in c.get("/openapi.json").json()["paths"]


# ----- a dead engine loop ------------------------------------------------------------------------
class _Fatal(BaseException):
    pass


def test_a_dead_engine_loop_turns_health_503_and_fails_streams(model_dir):
    with LiveServer(model_dir, n_cells=512) as srv, srv.client() as c:
        def die():
            raise _Fatal("simulated engine death")

        srv.engine.engine.step = die
        with c.stream("POST", "/v1/completions", json={**OK, "stream": True}) as r:
            lines = list(r.iter_lines())
        events = [json.loads(x[6:]) if x[6:] != "[DONE]" else x[6:] for x in lines if x.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" in events[-2]
        health = c.get("/health")
        assert health.status_code == 503 and "engine loop stopped" in health.json()["error"]["message"]
        assert c.post("/v1/completions", json=OK).status_code == 503
        assert c.get("/v1/sequences").status_code == 503
        assert srv.fatal and "simulated engine death" in srv.fatal[0]
        assert c.get("/metrics").status_code == 200


def test_the_server_process_exits_1_when_its_engine_loop_dies(model_dir, tmp_path):
    """A real `cellserve serve` process whose engine loop dies on its first forward: the stream ends
    with an error event, /health says 503, and the process exits with status 1 by itself."""
    port = free_port()
    script = tmp_path / "dying_server.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from engine.core.engine import Engine
        class Fatal(BaseException):
            pass
        def die(self):
            raise Fatal("simulated engine death")
        Engine.step = die
        from server.cli import main
        sys.exit(main(["serve", "--model", {model_dir!r}, "--port", "{port}", "--n-cells", "256",
                       "--threads", "1", "--shutdown-grace", "2"]))
    """))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180  # as ServerProcess.start: a loaded machine starts slowly
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        with httpx.stream("POST", url + "/v1/completions", json={**OK, "stream": True}, timeout=30) as r:
            text = "".join(r.iter_lines())
        assert "simulated engine death" in text and "[DONE]" in text
        assert proc.wait(timeout=30) == 1
        out = proc.stdout.read().decode()
        assert "engine loop stopped" in out
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

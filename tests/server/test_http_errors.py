"""Every error status with OpenAI's body shape; bad requests change nothing and the server stays healthy."""

import threading

import httpx
import openai
import pytest
from http_support import API_KEY, LONG_TOKENS, MODEL_NAME, LiveServer, metric_value

from engine.core.async_engine import AsyncEngine

OK = {"prompt": "ROMEO:", "max_tokens": 2}
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv(model_dir):
    with LiveServer(model_dir, n_cells=600) as server:
        yield server


def assert_error(r: httpx.Response, status: int, param: str | None = "__any__") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if param != "__any__":
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [1, 2]}, "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": [1, -1]}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "alien", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/sequences", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
])
def test_bad_fields_are_400_naming_the_param(srv, path, body, param):
    with srv.client() as c:
        err = assert_error(c.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw,ctype", [(b"{garbage", "application/json"), (b"", "application/json"),
                                       (b"[1, 2]", "application/json"), (b"prompt=x", "text/plain")])
def test_garbage_bodies_are_400(srv, raw, ctype):
    with srv.client() as c:
        assert_error(c.post("/v1/completions", content=raw, headers={"content-type": ctype}), 400)


def test_unknown_ids_and_routes_are_404(srv):
    with srv.client() as c:
        for method, path in [("GET", "/v1/sequences/seq-nope"), ("POST", "/v1/sequences/seq-nope/fork"),
                             ("POST", "/v1/sequences/seq-nope/completions"), ("DELETE", "/v1/sequences/x"),
                             ("POST", "/v1/sequences/seq-nope/truncate"), ("POST", "/v1/requests/r-nope/cancel"),
                             ("GET", "/v1/nothing-here")]:
            body = {"length": 1} if path.endswith("truncate") else {}
            err = assert_error(c.request(method, path, json=body if method == "POST" else None), 404)
            assert err["type"] == "not_found_error"
        assert_error(c.delete("/v1/completions"), 405)


def test_sequence_argument_ranges_are_400(srv):
    with srv.client() as c:
        seq = c.post("/v1/sequences", json={"prompt": "ROMEO: hello"}).json()
        assert_error(c.post(f"/v1/sequences/{seq['id']}/fork", json={"at": 999}), 400, "at")
        assert_error(c.post(f"/v1/sequences/{seq['id']}/fork", json={"at": -1}), 400, "at")
        assert_error(c.post(f"/v1/sequences/{seq['id']}/truncate", json={"length": 999}), 400, "length")
        assert_error(c.post(f"/v1/sequences/{seq['id']}/truncate", json={}), 400, "length")
        assert_error(c.post(f"/v1/sequences/{seq['id']}/completions", json={"n": 2}), 400, "n")
        c.delete(f"/v1/sequences/{seq['id']}")


def test_context_overflow_is_400_context_length_exceeded(srv):
    """OpenAI's and vLLM's shape: 400 with code context_length_exceeded (clients' overflow handling
    looks for a 400)."""
    with srv.client() as c:
        err = assert_error(c.post("/v1/completions", json={"prompt": "x " * 600, "max_tokens": 4}), 400)
        assert err["code"] == "context_length_exceeded"
        err = assert_error(c.post("/v1/completions", json={"prompt": "ROMEO", "max_tokens": 5000}), 400)
        assert (err["code"], err["param"]) == ("context_length_exceeded", "max_tokens")
        # fits the model's context (512) but not the pool (600 cells) with n=3
        err = assert_error(c.post("/v1/completions", json={"prompt": "ROMEO", "max_tokens": 300, "n": 3}), 400)
        assert err["code"] == "context_length_exceeded"


def test_busy_sequence_is_409(long_model_dir):
    with LiveServer(long_model_dir, n_cells=8192) as srv, srv.client() as c:
        seq = c.post("/v1/sequences", json={"prompt": "ROMEO:"}).json()
        started = threading.Event()

        def long_generate() -> None:
            with httpx.Client(base_url=srv.url, timeout=60) as c2, c2.stream(
                    "POST", f"/v1/sequences/{seq['id']}/completions",
                    json={"max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        started.set()

        t = threading.Thread(target=long_generate)
        t.start()
        assert started.wait(30)
        err = assert_error(c.post(f"/v1/sequences/{seq['id']}/completions", json={"max_tokens": 1}), 409)
        assert err["type"] == "conflict_error" and err["code"] == "sequence_busy"
        assert_error(c.post(f"/v1/sequences/{seq['id']}/truncate", json={"length": 1}), 409)
        c.delete(f"/v1/sequences/{seq['id']}")
        t.join(30)
        assert not t.is_alive()


def test_openai_sdk_raises_typed_errors(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=-1)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x" * 2000, max_tokens=4)
    assert info.value.body["code"] == "context_length_exceeded"


def test_server_is_healthy_after_all_that(srv):
    with srv.client() as c:
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json=OK).status_code == 200
    assert srv.wait_idle()["sequences"] == []


def test_api_key_is_required_when_set(model_dir):
    with LiveServer(model_dir, api_key=API_KEY, n_cells=256) as srv, httpx.Client(base_url=srv.url) as anon:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            err = assert_error(anon.post("/v1/completions", json=OK, headers=headers), 401)
            assert err["type"] == "authentication_error"
        assert_error(anon.get("/v1/models"), 401)
        assert_error(anon.delete("/v1/cache/prefixes"), 401)
        assert anon.get("/health").status_code == 200 and anon.get("/metrics").status_code == 200
        with srv.client() as c:
            assert c.post("/v1/completions", json=OK).status_code == 200
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        assert good.models.list().data[0].id == MODEL_NAME


def test_503_while_loading_then_ready_then_draining(model_dir):
    release = threading.Event()

    def slow_factory():
        release.wait(60)
        return AsyncEngine.from_pretrained(model_dir, n_cells=256)

    with LiveServer(model_dir, factory=slow_factory) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        err = assert_error(c.get("/health"), 503)
        assert err["type"] == "unavailable_error" and "loading" in err["message"]
        assert_error(c.post("/v1/completions", json=OK), 503)
        release.set()
        for _ in range(600):
            if c.get("/health").status_code == 200:
                break
            threading.Event().wait(0.05)
        assert c.post("/v1/completions", json=OK).status_code == 200
        srv.ctx.begin_drain()  # what SIGTERM does first (see test_http_cli for the real signal)
        assert "shutting down" in assert_error(c.get("/health"), 503)["message"]
        assert_error(c.post("/v1/completions", json=OK), 503)
        # the two refused completions count as errors; /health probes answering 503 do not
        assert metric_value(srv, "cellserve:request_errors_total", status="503") == 2


def test_queue_full_is_429_with_retry_after(model_dir):
    with LiveServer(model_dir, n_cells=1024, max_num_seqs=1, max_queue=1) as srv:
        import asyncio

        async def burst() -> list[httpx.Response]:
            async with srv.async_client() as client:
                body = {"prompt": "ROMEO:", "max_tokens": 200, "ignore_eos": True}
                return await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(8)])

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert 429 in codes and set(codes) <= {200, 429}, codes
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert assert_error(r, 429)["type"] == "rate_limit_error"
            else:
                assert r.json()["usage"]["completion_tokens"] == 200
        with srv.client() as c:
            assert c.get("/health").status_code == 200
            assert c.post("/v1/completions", json=OK).status_code == 200

"""The HTTP edge against a real server (issue #30; `server.http_edge`): request-head limits (414 for a
long URL, 431 for a long header line or head), JSON bodies in the API's error shape for what the HTTP
parser refuses (501 for an unknown method, 400 for a malformed request), and a 413 that the client
reads even while it is still sending its body (lingering close; `Expect: 100-continue` answered before
the body). Raw sockets where the client must misbehave; httpx where an ordinary client should cope."""

import argparse
import json
import socket
import time

import httpx
import pytest
from http_support import LiveServer

from server.cli import serve_parser
from server.config import limits_of
from server.limits import Limits

MAX_BODY = 64 * 1024
LIMITS = Limits(max_body_bytes=MAX_BODY, max_header_bytes=16 * 1024)  # a line: 2 KiB
OK = {"prompt": "ROMEO:", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def srv(model_dir):
    with LiveServer(model_dir, limits=LIMITS) as server:
        yield server


def exchange(port: int, data: bytes, *, chunk: int = 65536, timeout: float = 10) -> tuple[int, dict, bytes]:
    """Send `data` (in pieces, as a client that keeps sending would), then read the whole answer.
    Sending stops quietly if the server stops reading; a reset anywhere fails the test."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            for i in range(0, len(data), chunk):
                s.sendall(data[i:i + chunk])
        except BrokenPipeError:
            pass  # the server shut its reading side: fine, the answer must still be readable
        s.shutdown(socket.SHUT_WR)
        raw = b""
        while part := s.recv(65536):
            raw += part
    return parse(raw)


def parse(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    return status, headers, body


def api_error(status: int, headers: dict, body: bytes, expected: int) -> dict:
    assert status == expected, body[:300]
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    assert headers["connection"] == "close"
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


def still_serves(srv: LiveServer) -> None:
    with srv.client() as c:
        assert c.post("/v1/completions", json=OK).status_code == 200


# ----- head limits --------------------------------------------------------------------------------
def test_a_100kb_url_is_414_json(srv):
    status, headers, body = exchange(srv.port, b"GET /v1/models?q=" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert api_error(status, headers, body, 414)["code"] == "uri_too_long"
    still_serves(srv)


@pytest.mark.parametrize("chunk", [65536, 1000])  # in one read, or trickled (the buffered-head bound)
def test_a_200kb_header_line_is_431_json(srv, chunk):
    data = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 200_000 + b"\r\n\r\n"
    status, headers, body = exchange(srv.port, data, chunk=chunk)
    err = api_error(status, headers, body, 431)
    assert err["code"] == "header_too_large" and "--max-header-bytes" in err["message"]
    still_serves(srv)


def test_many_small_headers_over_the_total_are_431(srv):
    lines = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(20))  # 20 KiB, each line < 2 KiB
    status, headers, body = exchange(srv.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")
    assert api_error(status, headers, body, 431)["code"] == "header_too_large"


def test_heads_within_the_limits_pass_through_httpx(srv):
    with srv.client() as c:
        assert c.get("/v1/models", headers={"X-Ok": "o" * 1900}).status_code == 200  # a line just under 2 KiB
        many = {f"X-H{i}": "v" * 1000 for i in range(12)}  # 12 KiB of headers, under 16 KiB
        assert c.get("/v1/models", headers=many).status_code == 200
        r = c.get("/v1/models", headers={"X-Big": "b" * 200_000})  # httpx reads the 431 too
        assert r.status_code == 431 and r.json()["error"]["code"] == "header_too_large"


def test_the_header_limit_is_a_flag():  # a size, as --max-body-bytes
    args = serve_parser(argparse.ArgumentParser()).parse_args(["--max-header-bytes", "1MiB"])
    limits = limits_of(args)
    assert limits.max_header_bytes == 2**20 and limits.header_line_bytes == 2**17
    assert Limits().max_header_bytes == 64 * 1024 and Limits().header_line_bytes == 8 * 1024


# ----- what the parser refuses, as JSON -----------------------------------------------------------
@pytest.mark.parametrize("raw,status,code", [
    (b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n", 501, "method_not_implemented"),
    (b"GARBAGE\r\n\r\n", 400, "invalid_http_request"),
    (b"GET /x HTTP/1.1 extra\r\nHost: x\r\n\r\n", 400, "invalid_http_request"),
    (b"GET / HTTP/9.9\r\n\r\n", 400, "invalid_http_request"),
    (b"GET /v1/models HTTP/1.1\r\nBad Header: x\r\n\r\n", 400, "invalid_http_request"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400,
     "invalid_http_request"),
])
def test_parser_refusals_are_json(srv, raw, status, code):
    assert api_error(*exchange(srv.port, raw), status)["code"] == code


def test_a_known_method_the_api_lacks_is_405_json(srv):
    status, _, body = exchange(srv.port, b"PROPFIND /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 405 and json.loads(body)["error"]["type"] == "invalid_request_error"


# ----- a 413 the client reads ---------------------------------------------------------------------
def post_head(length: int, extra: str = "") -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def test_a_raw_client_still_sending_20mb_reads_the_413(srv):
    body = b"x" * (20 * 2**20)
    for _ in range(3):  # a reset would show up as ConnectionResetError in exchange()
        err = api_error(*exchange(srv.port, post_head(len(body)) + body), 413)
        assert err["code"] == "body_too_large"
    still_serves(srv)


def test_httpx_posting_20mb_reads_the_413(srv):
    body = json.dumps({"prompt": "x" * (20 * 2**20)}).encode()
    with srv.client() as c:
        for _ in range(3):
            r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
            assert r.headers["connection"] == "close"

        def chunks():  # no Content-Length: refused as the bytes pass the limit; the rest is read and dropped
            for _ in range(300):
                yield b"y" * 65536

        r = c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.headers["connection"] == "close"
    still_serves(srv)


def test_expect_100_continue_gets_the_413_before_any_body(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(post_head(20 * 2**20, "Expect: 100-continue\r\n"))
        raw = b""
        while part := s.recv(65536):  # the server answers and shuts its side without waiting for a body
            raw += part
    assert not raw.startswith(b"HTTP/1.1 100")
    assert api_error(*parse(raw), 413)["code"] == "body_too_large"


def test_a_refused_client_that_never_stops_is_cut_off(srv, monkeypatch):
    """The lingering close is bounded: a client sending past LINGER_MAX_BYTES is closed (here 1 MiB)."""
    monkeypatch.setattr("server.http_edge.LINGER_MAX_BYTES", 2**20)
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(post_head(100 * 2**20))
        with pytest.raises(OSError):  # reset or broken pipe once the server stops reading
            for _ in range(1600):
                s.sendall(b"z" * 65536)
    assert time.monotonic() - t0 < 10
    still_serves(srv)


def test_keep_alive_survives_ordinary_errors(srv):
    """An app-level refusal that read the body (a 400) keeps the connection; the edge only closes after
    413s and its own refusals."""
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r1 = c.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r1.status_code == 400 and r1.headers.get("connection") != "close"
        assert c.post("/v1/completions", json=OK).status_code == 200


def test_metrics_expose_the_process_rss(srv):
    """/metrics carries prometheus_client's process collector (RSS, open fds), so memory is watchable."""
    with srv.client() as c:
        text = c.get("/metrics").text
    rss = [line for line in text.splitlines() if line.startswith("process_resident_memory_bytes ")]
    assert rss and float(rss[0].split()[1]) > 10 * 2**20
    assert any(line.startswith("process_open_fds ") for line in text.splitlines())
    peak = [line for line in text.splitlines() if line.startswith("cellserve:process_peak_resident_memory_bytes ")]
    assert peak and float(peak[0].split()[1]) >= float(rss[0].split()[1])  # #26: the peak, never below RSS


def edge_refusals(srv: LiveServer) -> dict[str, float]:
    with srv.client() as c:
        text = c.get("/metrics").text
    prefix = 'cellserve:http_edge_refusals_total{status="'
    return {line[len(prefix):].split('"')[0]: float(line.split()[-1])
            for line in text.splitlines() if line.startswith(prefix)}


def test_edge_refusals_are_counted_in_metrics_by_status(srv):
    """The app never sees what the edge refuses, so its error counter cannot count them: the edge does."""
    before = edge_refusals(srv)
    exchange(srv.port, b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n")
    exchange(srv.port, b"GET /v1/models?q=" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    exchange(srv.port, b"GET /v1/models?q=" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    after = edge_refusals(srv)
    assert after.get("501", 0) - before.get("501", 0) == 1
    assert after.get("414", 0) - before.get("414", 0) == 2

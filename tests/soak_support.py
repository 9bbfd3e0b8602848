"""Support for the soak test (tests/test_soak.py): a real `cellserve serve` process and the client side of
the storm.

`ServerProcess` runs the CLI as a child process and can always be ended (SIGTERM, then SIGKILL).
`Soak` wraps one httpx.AsyncClient: every response goes through `Soak.record`, which counts statuses
and remembers anything the contract forbids (a 5xx, a 429 without Retry-After, a non-OpenAI error
shape), so a round can fail with the full list instead of the first symptom. A 429 outside the burst
is retried after its Retry-After, as a well-behaved client would. Nothing here is mocked: every check
is made on what the real server sent back.
"""

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MAX_429_RETRIES = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`cellserve serve` as a child process on 127.0.0.1; `kill()` is safe to call in any state."""

    def __init__(self, model_dir: str, log_path: Path, *, n_cells: int, max_queue: int, max_num_seqs: int,
                 max_body_bytes: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.max_queue, self.max_num_seqs, self.max_body_bytes = max_queue, max_num_seqs, max_body_bytes
        self.cmd = [
            sys.executable,
            "-m",
            "server.cli",
            "serve",
            "--model",
            model_dir,
            "--dtype",
            "float32",  # as Greedy and the oracles (tests/http_support.py): auto is bf16 on AVX512-BF16 CPUs
            "--port",
            str(self.port),
            "--n-cells",
            str(n_cells),
            "--max-queue",
            str(max_queue),
            "--max-num-seqs",
            str(max_num_seqs),
            "--max-body-bytes",
            str(max_body_bytes),
            "--threads",
            "1",
            "--shutdown-grace",
            "30",
            "--log-level",
            "warning",
        ]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180) -> None:
        """Spawn the server and return once GET /health is 200 (503 while loading is expected)."""
        env = {**os.environ, "PYTHONPATH": str(ROOT)}  # oneDNN's caches: the engine's bounds (engine/model/onednn.py)
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.2)
        raise AssertionError(
            f"server never became healthy (exit code {self.proc.poll()}):\n{self.log_tail()}"
        )

    def rss_mb(self) -> float:
        """The server's resident set size (VmRSS from /proc), in MiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS line in /proc/<pid>/status")

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM and wait for the exit code (SIGKILL, and an AssertionError, if it does not exit)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server ignored SIGTERM for {timeout}s:\n{self.log_tail()}") from None

    def kill(self) -> None:
        """End the process we started, whatever state it is in: SIGTERM, then SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(lines[-n:])


def sse_event(line: str):
    """One `data: ...` SSE line as JSON (or the string '[DONE]'); None for any other line."""
    if not line.startswith("data: "):
        return None
    data = line[len("data: ") :]
    return data if data == "[DONE]" else json.loads(data)


def streamed_text(events: list, chat: bool) -> tuple[str, str | None]:
    """The text and last finish_reason of a finished SSE stream; asserts it ended with [DONE], no error."""
    assert events and events[-1] == "[DONE]", f"stream did not end with [DONE]: {events[-3:]}"
    errors = [e for e in events[:-1] if "error" in e]
    assert not errors, f"error event mid-stream: {errors[0]}"
    text, finish = "", None
    for e in events[:-1]:
        for c in e["choices"]:
            text += (c["delta"].get("content") or "") if chat else c["text"]
            finish = c["finish_reason"] or finish
    return text, finish


async def read_events(lines: AsyncIterator[str], limit: int | None = None) -> list:
    """SSE events from an open stream's line iterator: all of them, or the next `limit` (the iterator
    stays usable, so a caller can read a few, act, then read the rest)."""
    events = []
    async for line in lines:
        event = sse_event(line)
        if event is not None:
            events.append(event)
            if limit is not None and len(events) >= limit:
                break
    return events


# ----- raw HTTP/1.1 over a socket: what httpx cannot do (hang up mid-request, withhold a body) -----
def raw_head(method: str, path: str, port: int, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def json_head(method: str, path: str, port: int, body: bytes) -> bytes:
    return raw_head(method, path, port, {"Content-Type": "application/json", "Content-Length": str(len(body))})


async def read_raw_response(reader: asyncio.StreamReader) -> httpx.Response | None:
    """The next response on the socket (Content-Length framed), or None if the server closed first."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = [tuple(h.split(": ", 1)) for h in header_lines if h]
    length = next((int(v) for k, v in headers if k.lower() == "content-length"), None)
    body = await (reader.readexactly(length) if length is not None else reader.read())
    return httpx.Response(int(status_line.split()[1]), headers=headers, content=body)


async def raw_exchange(port: int, head: bytes, parts: list[bytes] = (), timeout: float = 60) -> httpx.Response:
    """Send `head` then each of `parts` (waiting until each is written), then read the response.

    Nothing more is written after the last part, so a server that answers before reading the whole
    body (a 413) has read everything it was sent and closes cleanly instead of resetting."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        for part in parts:
            await asyncio.sleep(0.001)  # let the server read each part as it comes
            writer.write(part)
            await writer.drain()
        resp = await asyncio.wait_for(read_raw_response(reader), timeout)
        assert resp is not None, "the server closed the connection without answering"
        return resp
    finally:
        writer.close()


async def hang_up(port: int, request: bytes, delay: float, half_close: bool, timeout: float = 60) -> bytes:
    """Send a whole request, wait `delay` seconds, then close the socket: fully (what the server has not
    sent yet is lost) or only its sending side (the server sees the same disconnect, and whatever it
    had answered before it noticed can still be read here). Returns the bytes read (b"" on a full close)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        await asyncio.sleep(delay)
        if not half_close:
            return b""
        writer.write_eof()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def parse_raw(data: bytes) -> httpx.Response | None:
    """The response in bytes read by `hang_up`, or None if not even its head arrived. Its body is what
    arrived (cut at Content-Length): possibly partial, e.g. a stream cut by the hang-up."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = [tuple(h.split(": ", 1)) for h in header_lines if h]
    length = next((int(v) for k, v in headers if k.lower() == "content-length"), None)
    return httpx.Response(int(status_line.split()[1]), headers=headers, content=body[:length])


class Soak:
    """One storm client: an httpx.AsyncClient plus the tally every response is recorded in."""

    def __init__(self, url: str, rng: random.Random, refs: dict, max_connections: int = 64):
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.http = httpx.AsyncClient(base_url=url, timeout=120, limits=limits)
        self.url, self.rng, self.refs = url, rng, refs
        self.statuses: Counter = Counter()
        self.problems: list[str] = []
        self.greedy_checked = 0

    async def aclose(self) -> None:
        await self.http.aclose()

    # ----- recording -------------------------------------------------------------------------
    def record(self, kind: str, resp: httpx.Response, body: bytes | None = None) -> None:
        """Count the status; note a 5xx, a 429 without Retry-After, or an error body not in OpenAI's shape."""
        status = resp.status_code
        self.statuses[(kind, status)] += 1
        if status >= 500:
            self.problems.append(f"{kind}: HTTP {status}: {(body or b'')[:300]!r}")
        if status == 429 and not resp.headers.get("retry-after"):
            self.problems.append(f"{kind}: 429 without Retry-After")
        if status >= 400 and body is not None:
            self._check_error_shape(kind, status, body)

    def _check_error_shape(self, kind: str, status: int, body: bytes) -> None:
        try:
            err = json.loads(body)["error"]
            assert {"message", "type", "param", "code"} <= set(err) and err["message"]
        except Exception:  # noqa: BLE001 -- any deviation is the finding
            self.problems.append(f"{kind}: HTTP {status} body is not an OpenAI error: {body[:200]!r}")

    async def backoff(self, resp: httpx.Response) -> None:
        """Wait what the server's Retry-After asks (seconds), as a polite client does after a 429."""
        await asyncio.sleep(float(resp.headers.get("retry-after", "1")))

    # ----- requests --------------------------------------------------------------------------
    async def request(
        self, kind: str, method: str, path: str, *, expect=(200,), retry_429: bool = True, **kw
    ) -> httpx.Response:
        """One request (retried after each 429 when asked); asserts its final status is in `expect`."""
        for _ in range(MAX_429_RETRIES):
            resp = await self.http.request(method, path, **kw)
            self.record(kind, resp, resp.content)
            if resp.status_code == 429 and retry_429:
                await self.backoff(resp)
                continue
            assert resp.status_code in expect, (
                f"{kind}: {method} {path} -> {resp.status_code} {resp.text[:300]}"
            )
            return resp
        raise AssertionError(f"{kind}: still 429 after {MAX_429_RETRIES} tries")

    @contextlib.asynccontextmanager
    async def stream(self, kind: str, path: str, body: dict) -> AsyncIterator[tuple[str, AsyncIterator[str]]]:
        """(X-Request-Id, lines) of an open 200 SSE response (429s retried); leaving the block early
        drops the connection mid-stream, which the server must treat as a cancel."""
        for _ in range(MAX_429_RETRIES):
            async with self.http.stream("POST", path, json={**body, "stream": True}) as resp:
                if resp.status_code == 429:
                    self.record(kind, resp, await resp.aread())
                    await self.backoff(resp)
                    continue
                if resp.status_code != 200:
                    self.record(kind, resp, await resp.aread())
                    raise AssertionError(f"{kind}: stream {path} -> {resp.status_code} {resp.text[:300]}")
                self.record(kind, resp)
                lines = resp.aiter_lines()
                try:
                    yield resp.headers["x-request-id"], lines
                finally:
                    await lines.aclose()
                return
        raise AssertionError(f"{kind}: still 429 after {MAX_429_RETRIES} tries")

    def check_greedy(self, what: str, key: tuple, text: str, finish: str | None) -> None:
        """A finished greedy request must match its solo reference exactly and end by length."""
        assert finish == "length", f"{what}: finish_reason {finish!r}, want 'length'"
        assert text == self.refs[key], f"{what}: text {text!r} != solo reference {self.refs[key]!r}"
        self.greedy_checked += 1

    def check_prefix(self, what: str, key: tuple, text: str, finish: str | None) -> None:
        """A greedy stream cut short (cancel, drop) produced a prefix of its reference; the whole of it
        if it finished by length first. Detokenizing is incremental and holds back partial characters,
        so the cut never changes text already sent."""
        ref = self.refs[key]
        if finish == "length":
            assert text == ref, f"{what}: finished text != reference"
        else:
            assert ref.startswith(text), (
                f"{what}: {text!r} is not a prefix of the reference {ref[: len(text) + 8]!r}"
            )
        self.greedy_checked += 1

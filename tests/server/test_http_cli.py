"""`cellserve serve` as a real process: loads, logs what it serves, streams, and exits cleanly on SIGTERM."""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from http_support import sse_events

from server.cli import main, serve_parser
from server.config import engine_args_of

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> list[int]:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            code = httpx.get(url + "/health", timeout=5).status_code
            seen.append(code)
            if code == 200:
                return seen
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"server never became healthy (exit code {proc.poll()}, /health codes {seen})")


def test_serve_streams_then_drains_on_sigterm(model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model_dir, "--port", str(port),
           "--n-cells", "512", "--threads", "1", "--shutdown-grace", "20", "--served-model-name", "tiny"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        codes = wait_healthy(url, proc)
        assert set(codes) <= {200, 503}
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
        first = threading.Event()
        result: dict = {}

        def stream() -> None:
            body = {"prompt": "ROMEO:", "max_tokens": 300, "ignore_eos": True, "stream": True}
            with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    first.set()
                result["events"] = sse_events(lines)

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = result["events"]
    assert events[-1] == "[DONE]"  # the in-flight stream was finished, not cut
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    text = log.read_text()
    assert f"listening on http://127.0.0.1:{port}" in text
    assert "cell pool: 512 cells" in text and "loaded" in text


def test_serve_exits_1_when_the_model_cannot_load(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(tmp_path / "missing"), "--port", str(port)]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "failed to load" in proc.stderr + proc.stdout


def test_bench_dispatch_needs_a_subcommand(capsys):
    assert main(["bench"]) == 2
    assert "cellserve bench {serve,engine,compare,overhead}" in capsys.readouterr().err


def test_serve_rejects_conflicting_pool_options():
    with pytest.raises(SystemExit):
        main(["serve", "--n-cells", "10", "--kv-memory", "1GiB"])


def test_no_warmup_is_a_serve_flag():
    parser = serve_parser(argparse.ArgumentParser())
    assert engine_args_of(parser.parse_args([])).warmup is True
    assert engine_args_of(parser.parse_args(["--no-warmup"])).warmup is False

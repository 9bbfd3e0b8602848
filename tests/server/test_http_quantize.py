"""`cellserve serve --quantize int8` as a real process: the flag reaches the loader (server/cli.py ->
server/config.py -> EngineArgs), the log says what is served, and a completion is the in-process
`LLM(model, quantize="int8")`'s greedy output token for token."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.api.sampling_params import SamplingParams
from engine.core.llm import LLM

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"server never became healthy (exit code {proc.poll()})")


def test_serve_quantize_int8_answers_a_completion(model_dir, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model_dir, "--port", str(port),
           "--quantize", "int8", "--n-cells", "256", "--threads", "1", "--shutdown-grace", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        _wait_healthy(url, proc)
        body = {"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        got = httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status().json()
    finally:
        proc.terminate()
        proc.wait(30)
    assert "linears quantized to int8" in log.read_text()
    llm = LLM(model_dir, quantize="int8", n_cells=256)
    want = llm.generate(["ROMEO:"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert got["choices"][0]["text"] == want[0].outputs[0].text
    assert got["usage"]["completion_tokens"] == 12

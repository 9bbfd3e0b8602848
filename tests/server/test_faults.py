"""Faults of what the server relies on (issue #30): the tokenizer raising on an input, and the fused
kernels failing to build at start. (A grammar that compiles too long: test_structured_output.py; a full
disk under --state-dir: the durable-sequence tests.) Each must cost at most the request that met it, with
a clear error, and the server goes on serving."""

import os

import httpx
from http_support import LiveServer
from soak_support import ServerProcess


def test_a_tokenizer_that_raises_on_an_input_is_a_400_and_the_server_goes_on(model_dir):
    with LiveServer(model_dir, n_cells=512) as srv, srv.client() as c:
        tok = srv.ctx.tokens.tok
        real_encode = tok.encode

        def encode(text, *args, **kwargs):  # a tokenizer bug met by one odd input
            if "\u2063" in text:
                raise ValueError("unexpected invisible separator")
            return real_encode(text, *args, **kwargs)

        tok.encode = encode
        r = c.post("/v1/completions", json={"prompt": "a\u2063b", "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt", r.text
        assert "tokenizer could not encode" in err["message"] and "invisible separator" in err["message"]
        assert c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
        stats = srv.engine.stats()
        assert stats.waiting == 0 and stats.running == 0


def test_a_kernel_build_that_fails_at_start_falls_back_with_one_log_line(model_dir, tmp_path, monkeypatch):
    """A fresh kernel cache and a compiler that fails: the server starts on eager ops, says so once."""
    monkeypatch.setenv("CELLSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", "/bin/false")
    srv = ServerProcess(model_dir, tmp_path / "serve.log", n_cells=512, max_queue=8, max_num_seqs=8,
                        max_body_bytes=1 << 20)
    try:
        srv.start()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        srv.kill()
    log = (tmp_path / "serve.log").read_text()
    lines = [line for line in log.splitlines() if "fused CPU kernels off" in line]
    assert len(lines) == 1 and "build failed" in lines[0], log[-2000:]
    assert "Traceback" not in log
    assert os.environ["CXX"] == "/bin/false"  # the child saw it (ServerProcess passes the environment on)

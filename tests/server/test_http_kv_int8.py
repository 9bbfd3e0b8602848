"""`cellserve serve --kv-cache-dtype int8` as a real process: the flag reaches the cell pool (server/cli.py ->
server/config.py -> EngineArgs -> ModelRunner), `/v1/cache` says so with the int8 cell size, and a
completion is the in-process `LLM(model, kv_cache_dtype="int8")`'s greedy output token for token. A value
the flag does not know is refused before anything loads."""

import httpx
import pytest
from soak_support import ServerProcess

from engine.api.sampling_params import SamplingParams
from engine.core.llm import LLM
from server.cli import main

INT8_CELL_BYTES = 2 * 2 * 2 * (8 + 4)  # K and V, 2 layers, 2 kv heads, 8 int8 values + a float32 scale each


def test_serve_kv_cache_dtype_int8_answers_a_completion(model_dir, tmp_path):
    srv = ServerProcess(model_dir, tmp_path / "serve.log", n_cells=256, max_queue=16, max_num_seqs=4,
                        max_body_bytes=1 << 20)
    srv.cmd += ["--kv-cache-dtype", "int8"]
    try:
        srv.start()
        body = {"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        got = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).raise_for_status().json()
        cache = httpx.get(srv.url + "/v1/cache", timeout=10).raise_for_status().json()
    finally:
        srv.kill()
    assert cache["kv_cache_dtype"] == "int8" and cache["cell_bytes"] == INT8_CELL_BYTES
    assert cache["pool_bytes"] == 256 * INT8_CELL_BYTES
    llm = LLM(model_dir, dtype="float32", kv_cache_dtype="int8", n_cells=256)  # ServerProcess serves float32
    want = llm.generate(["ROMEO:"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    assert got["choices"][0]["text"] == want[0].outputs[0].text
    assert got["usage"]["completion_tokens"] == 12


def test_serve_refuses_an_unknown_kv_cache_dtype(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--kv-cache-dtype", "fp8"])
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "invalid choice: 'fp8'" in err and "'int8'" in err

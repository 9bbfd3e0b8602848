"""`cellserve serve --draft-model` as a real process: the flag reaches the engine (server/cli.py ->
server/config.py -> EngineArgs), the log says a draft model drafts, a greedy completion is the in-process
`LLM(model, speculative="off")`'s output token for token, and usage and /metrics count the drafts."""

import httpx
from soak_support import ServerProcess

from engine.api.sampling_params import SamplingParams
from engine.core.llm import LLM

PROMPT = "ROMEO: what light through yonder window breaks"


def test_serve_with_a_draft_model_answers_as_without_drafts(model_dir, tmp_path):
    srv = ServerProcess(model_dir, tmp_path / "serve.log", n_cells=512, max_queue=16, max_num_seqs=4,
                        max_body_bytes=1 << 20)
    srv.cmd += ["--draft-model", model_dir, "--speculative", "ngram", "--num-speculative-tokens", "3",
                "--log-level", "info"]
    try:
        srv.start()
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        got = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).raise_for_status().json()
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    finally:
        srv.kill()
    assert "drafts for speculative decoding" in srv.log_path.read_text()
    llm = LLM(model_dir, dtype="float32", speculative="off", n_cells=512)  # ServerProcess serves float32
    want = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    assert got["choices"][0]["text"] == want[0].outputs[0].text
    details = got["usage"]["cellserve_draft_tokens"]
    assert details["accepted"] > 0, details
    accepted = [line for line in metrics.splitlines() if line.startswith("cellserve:spec_decode_num_accepted_tokens")]
    assert accepted and float(accepted[0].split()[-1]) == details["accepted"]

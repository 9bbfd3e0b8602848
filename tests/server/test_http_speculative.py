"""Speculative decoding over HTTP: the same text with drafts on or off, and OpenAI's usage fields and
vLLM's /metrics counters saying how many drafted tokens were kept."""

import json

import httpx
from http_support import LiveServer

# A text that repeats itself: prompt lookup can guess its continuation.
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"


def _complete(srv, stream: bool) -> tuple[str, dict]:
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stream": stream}
    if not stream:
        out = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()
        return out["choices"][0]["text"], out["usage"]
    body["stream_options"] = {"include_usage": True}
    text, use = "", None
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk["choices"])
                use = chunk.get("usage") or use
    return text, use


def test_drafts_change_nothing_a_client_reads_but_the_usage_details(model_dir):
    with LiveServer(model_dir, speculative="off") as srv:
        plain, plain_use = _complete(srv, stream=False)
    assert "completion_tokens_details" not in plain_use and "cellserve_draft_tokens" not in plain_use
    with LiveServer(model_dir, speculative="ngram") as srv:
        for stream in (False, True):
            text, use = _complete(srv, stream)
            assert text == plain
            assert "completion_tokens_details" not in use  # OpenAI's fields: Predicted Outputs only
            details = use["cellserve_draft_tokens"]
            assert details["accepted"] > 0
            assert details["accepted"] + details["rejected"] > 0
            assert use["completion_tokens"] == plain_use["completion_tokens"]
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
    accepted = [line for line in metrics.splitlines() if line.startswith("cellserve:spec_decode_num_accepted_tokens")]
    assert accepted and float(accepted[0].split()[-1]) > 0


def test_a_prediction_is_a_draft_source_and_changes_nothing_but_the_usage(model_dir):
    """OpenAI's predicted outputs: with the plain reply as `prediction`, the same reply comes back with part
    of it accepted from the prediction; a wrong one gives the same reply too; a malformed one is a 400. (A
    prediction is text: where its tokenization differs from the tokens the model produced, drafts miss
    until an n-gram re-aligns them; the engine test checks the token-exact case. "ngram" drafts every tick;
    "auto" prices drafts by measured step times, so on a loaded machine its counts move (3 against 4 once).)"""
    with LiveServer(model_dir, speculative="ngram") as srv, srv.client() as c:
        for route, body in (("/v1/completions", {"prompt": "JULIET: O Romeo"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}]})):
            body = {**body, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            plain = c.post(route, json=body).json()
            text = plain["choices"][0].get("text") or plain["choices"][0]["message"]["content"]
            accepted = []
            for predicted in (text, "nothing like it at all " * 3):
                parts = [{"type": "text", "text": predicted}]  # the list form of `content`
                got = c.post(route, json={**body, "prediction": {"type": "content", "content": parts}}).json()
                assert got["choices"] == plain["choices"]
                details = got["usage"].get("completion_tokens_details") or {"accepted_prediction_tokens": 0}
                accepted.append(details["accepted_prediction_tokens"])
            assert accepted[0] >= 4 and accepted[1] < accepted[0], (route, accepted)
        r = c.post("/v1/completions", json={"prompt": "x", "prediction": {"type": "image", "content": "x"}})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("prediction"), r.text

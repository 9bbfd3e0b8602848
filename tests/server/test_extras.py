"""The common extras other servers accept (issue #27), each through a real server over the bundled model:
vLLM's min_tokens, include_stop_str_in_output, allowed_token_ids, bad_words, truncate_prompt_tokens and
priority, llama.cpp's grammar/json_schema names, OpenAI's prediction; and reasoning: `<think>` split
into reasoning_content, chat_template_kwargs / reasoning_effort reaching a template's thinking switch."""

import json

import pytest
from http_support import LiveServer
from tool_support import TEMPLATES, save_model_dir, stream_chat

from engine.loader.default import DEFAULT_MODEL_DIR

MESSAGES = [{"role": "user", "content": "Is it so?"}]
A, B = 10, 11  # two token ids of the bundled vocabulary


@pytest.fixture(scope="module")
def srv():
    with LiveServer(str(DEFAULT_MODEL_DIR), n_cells=4096) as server:
        yield server


def complete(srv, **body) -> dict:
    with srv.client() as c:
        r = c.post("/v1/completions", json={"prompt": "ROMEO:", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_min_tokens_masks_stop_tokens_until_reached(srv):
    rule = {"allowed_token_ids": [A, B], "logit_bias": {str(A): 100}, "stop_token_ids": [A], "max_tokens": 8}
    eager = complete(srv, **rule)
    assert eager["choices"][0]["finish_reason"] == "stop" and eager["usage"]["completion_tokens"] == 1
    held = complete(srv, **rule, min_tokens=3)
    assert held["choices"][0]["finish_reason"] == "stop" and held["choices"][0]["stop_reason"] == A
    assert held["usage"]["completion_tokens"] == 4  # three B's, then the stop token


def test_allowed_token_ids_and_bad_words(srv):
    with srv.client() as c:
        strs = {c.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in (A, B)}
    out = complete(srv, max_tokens=6, allowed_token_ids=[A, B], logprobs=0)
    assert set(out["choices"][0]["logprobs"]["tokens"]) <= strs
    free = complete(srv, max_tokens=8)["choices"][0]["text"]
    word = free.split()[0]
    banned = complete(srv, max_tokens=8, bad_words=[word])["choices"][0]["text"]
    assert banned.split()[:1] != [word], (free, banned)


def test_include_stop_str_in_output_whole_and_streamed(srv):
    free = complete(srv, max_tokens=12)["choices"][0]["text"]
    stop = free[4:7]
    cut = complete(srv, max_tokens=12, stop=[stop])["choices"][0]
    kept = complete(srv, max_tokens=12, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == cut["text"] + stop and kept["finish_reason"] == "stop"
    deltas, _ = stream_chat(srv, {"messages": MESSAGES, "max_tokens": 12, "temperature": 0})
    text = "".join(d["delta"].get("content") or "" for d in deltas)
    stop = text[3:6]
    deltas, _ = stream_chat(srv, {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "stop": [stop],
                                  "include_stop_str_in_output": True})
    assert "".join(d["delta"].get("content") or "" for d in deltas).endswith(stop)


def test_truncate_prompt_tokens_keeps_the_last_k(srv):
    long = complete(srv, prompt="ROMEO: But soft, what light through yonder window breaks?", max_tokens=1)
    assert long["usage"]["prompt_tokens"] > 5
    short = complete(srv, prompt="ROMEO: But soft, what light through yonder window breaks?", max_tokens=1,
                     truncate_prompt_tokens=5)
    assert short["usage"]["prompt_tokens"] == 5


def test_llama_cpp_grammar_names_priority_and_prediction(srv):
    yes = complete(srv, max_tokens=5, grammar='root ::= "yes" | "no"', priority=3,
                   prediction={"type": "content", "content": "yes"})
    assert yes["choices"][0]["text"] in ("yes", "no")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 30, "json_schema": schema})
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["a"], int)


def test_skip_special_tokens_false_keeps_their_text(srv):
    bos = {"allowed_token_ids": [1], "max_tokens": 2}  # <|bos|>: special, and no stop token
    assert complete(srv, **bos)["choices"][0]["text"] == ""
    for extra in ({}, {"stop": ["never"]}):  # detokenized by the consumer, or by the engine (stop strings)
        kept = complete(srv, **bos, **extra, skip_special_tokens=False, spaces_between_special_tokens=False)
        assert kept["choices"][0]["text"] == "<|bos|><|bos|>", extra


def test_stop_strings_wait_for_min_tokens(srv):
    free = complete(srv, max_tokens=12)["choices"][0]
    word = free["text"][:3]
    assert complete(srv, max_tokens=12, stop=[word])["choices"][0]["text"] == ""
    held = complete(srv, max_tokens=12, stop=[word], min_tokens=6)
    text = held["choices"][0]["text"]
    assert text.startswith(word) and free["text"].startswith(text) and held["usage"]["completion_tokens"] > 6


def test_sequence_completions_take_the_extras(srv):
    with srv.client() as c:
        seq = c.post("/v1/sequences", json={"prompt": "ROMEO:"}).json()["id"]
        free = c.post(f"/v1/sequences/{seq}/fork").json()["id"]
        text = c.post(f"/v1/sequences/{free}/completions", json={"max_tokens": 10, "temperature": 0}).json()
        stop = text["choices"][0]["text"][4:7]
        r = c.post(f"/v1/sequences/{seq}/completions", json={
            "max_tokens": 10, "temperature": 0, "stop": [stop], "include_stop_str_in_output": True,
            "min_tokens": 1, "bad_words": ["zebra"], "priority": 2, "skip_special_tokens": False})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == text["choices"][0]["text"][:7]


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "x", "skip_special_tokens": 0}, "skip_special_tokens"),
    ("/v1/sequences/seq-none/completions", {"prompt": "x", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "grammar": "root ::= x", "json_schema": {"type": "object"}}, "json_schema"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_what_stays_refused_is_a_400_naming_the_field(srv, route, body, param):
    with srv.client() as c:
        r = c.post(route, json={"max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ----- reasoning -------------------------------------------------------------------------------------------

THOUGHT = 'root ::= "I think so." "</think>" "Yes."'


@pytest.fixture(scope="module")
def think_srv(tmp_path_factory):
    with LiveServer(save_model_dir(tmp_path_factory.mktemp("think"), TEMPLATES["think"]), n_cells=4096) as server:
        yield server


def test_think_is_split_into_reasoning_content_whole_and_streamed(think_srv):
    body = {"messages": MESSAGES, "max_tokens": 30, "temperature": 0, "grammar": THOUGHT}
    with think_srv.client() as c:
        msg = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "I think so." and msg["content"] == "Yes."
    deltas, _ = stream_chat(think_srv, body)
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == "I think so."
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Yes."


def test_template_kwargs_and_reasoning_effort_reach_the_thinking_switch(think_srv):
    base = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "grammar": 'root ::= "Yes."'}
    with think_srv.client() as c:
        on = c.post("/v1/chat/completions", json=base).json()
        off = c.post("/v1/chat/completions", json={**base, "chat_template_kwargs": {"enable_thinking": False}}).json()
        none = c.post("/v1/chat/completions", json={**base, "reasoning_effort": "none"}).json()
        high = c.post("/v1/chat/completions", json={**base, "reasoning_effort": "high"}).json()
    assert off["usage"]["prompt_tokens"] == none["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]
    assert high["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"]
    assert on["choices"][0]["message"]["reasoning_content"] == "Yes." and on["choices"][0]["message"]["content"] is None
    assert off["choices"][0]["message"]["content"] == "Yes." and off["choices"][0]["message"]["reasoning_content"] is None

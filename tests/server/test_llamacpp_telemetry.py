"""llama.cpp's telemetry over a real server: `return_progress` streams `prompt_progress` from the engine's own
prefill chunks (one at admission with what the prefix cache held, then one per chunk of at most
`max_num_batched_tokens` tokens, the last at the whole prompt), `timings_per_token` puts `timings` in every
streamed chunk, with llama.cpp's arithmetic (the generation rate over n - 1 steps; nothing prefilled: zero
prompt time). On `/completion`, `/v1/chat/completions`, `/v1/completions` and `/v1/responses`; without the
fields nothing of it is sent; several choices are a 400 naming the field."""

import itertools
import json
import math

import pytest
from http_support import Greedy, LiveServer, sse_events

CHUNK = 16  # the server's max_num_batched_tokens: a prompt is prefilled in chunks of at most this many tokens
PROMPT = "the quick brown fox jumps over the lazy dog " * 6


@pytest.fixture(scope="module")
def greedy(model_dir):
    return Greedy(model_dir)


@pytest.fixture(scope="module")
def srv(model_dir):
    with LiveServer(model_dir, max_num_batched_tokens=CHUNK) as server:
        yield server


def _stream(srv, path: str, body: dict) -> list:
    with srv.client() as c, c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]


def _check_progress(progress: list[dict], total: int) -> None:
    """The engine's chunks, as llama.cpp reports them: first what the cache held, then one per chunk."""
    first, last = progress[0], progress[-1]
    assert first["processed"] == first["cache"] and first["time_ms"] >= 0
    assert last["processed"] == last["total"] == total
    assert len(progress) == 1 + math.ceil((total - first["cache"]) / CHUNK)
    for a, b in itertools.pairwise(progress):
        assert b["total"] == total and b["cache"] == first["cache"]
        assert 0 < b["processed"] - a["processed"] <= CHUNK and b["time_ms"] >= a["time_ms"]


def test_completion_streams_the_prefill_chunks_and_timings(srv, greedy):
    ids = greedy.tokenizer.encode(PROMPT)
    want = greedy(ids, 6)
    events = _stream(srv, "/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "cache_prompt": False,
                                           "return_progress": True, "timings_per_token": True})
    chunks = [e for e in events if "prompt_progress" in e]
    _check_progress([e["prompt_progress"] for e in chunks], len(ids))
    t0 = chunks[0]["timings"]
    assert t0["prompt_n"] == 0 and t0["prompt_ms"] == 0.0 and t0["predicted_n"] == 0 and t0["predicted_ms"] == 0.0
    prompt_ms = [e["timings"]["prompt_ms"] for e in chunks]
    assert prompt_ms == sorted(prompt_ms) and prompt_ms[-1] > 0
    assert [e["timings"]["prompt_n"] for e in chunks] == [p["prompt_progress"]["processed"] - p["prompt_progress"]
                                                          ["cache"] for p in chunks]
    texts = [e for e in events if "prompt_progress" not in e and not e["stop"]]
    assert "".join(e["content"] for e in texts) == want.text
    assert [e["timings"]["predicted_n"] for e in texts] == list(range(1, 7))  # timings on every token
    for e in events:
        assert all(v is not None and v >= 0 for v in e["timings"].values())
    final = events[-1]["timings"]
    assert final["predicted_n"] == 6 and final["prompt_n"] + final["cache_n"] == len(ids)
    assert final["predicted_per_second"] == pytest.approx(1e3 / final["predicted_ms"] * 5)  # 5 decode steps


def test_a_cached_prompt_reports_what_the_cache_held_first(srv, greedy):
    total = len(greedy.tokenizer.encode(PROMPT))
    body = {"prompt": PROMPT, "n_predict": 2, "temperature": 0, "return_progress": True}
    _stream(srv, "/completion", body)
    progress = [e["prompt_progress"] for e in _stream(srv, "/completion", body) if "prompt_progress" in e]
    assert progress[0]["cache"] > 0
    _check_progress(progress, total)


def test_one_token_costs_no_decode_step(srv):
    with srv.client() as c:
        t = c.post("/completion", json={"prompt": "hello world", "n_predict": 1, "temperature": 0}).json()["timings"]
    assert t["predicted_n"] == 1 and t["predicted_per_second"] == 0.0 and t["predicted_per_token_ms"] == 0.0
    assert t["prompt_ms"] > 0 and t["prompt_per_token_ms"] > 0 and t["prompt_n"] > 0


def test_without_the_fields_no_telemetry_is_streamed(srv):
    events = _stream(srv, "/completion", {"prompt": PROMPT, "n_predict": 3, "temperature": 0})
    assert not any("prompt_progress" in e for e in events)
    assert all("timings" not in e for e in events[:-1]) and "timings" in events[-1]
    chat = _stream(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3})
    assert not any("prompt_progress" in e or "timings" in e for e in chat)


def test_chat_streams_progress_chunks_without_a_choice_and_timings(srv):
    msgs = [{"role": "user", "content": "Tell me: " + PROMPT}]
    events = _stream(srv, "/chat/completions", {"messages": msgs, "max_tokens": 4, "temperature": 0,
                                                "return_progress": True, "timings_per_token": True,
                                                "stream_options": {"include_usage": True}})
    progress = [e for e in events if "prompt_progress" in e]
    assert all(e["choices"] == [] and e["object"] == "chat.completion.chunk" for e in progress)
    _check_progress([e["prompt_progress"] for e in progress], events[-1]["usage"]["prompt_tokens"])
    assert "timings" not in events[0]  # the opening role chunk, as llama-server
    deltas = [e for e in events if e["choices"]][1:]
    assert deltas and all("timings" in e for e in deltas)
    assert events[-1]["usage"]["completion_tokens"] == events[-1]["timings"]["predicted_n"] == 4


def test_completions_and_responses_take_the_fields_too(srv):
    events = _stream(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "return_progress": True})
    assert any("prompt_progress" in e for e in events) and "timings" in events[-1]
    with srv.client() as c, c.stream("POST", "/v1/responses", json={
            "input": PROMPT, "max_output_tokens": 4, "stream": True, "store": False,
            "timings_per_token": True, "return_progress": True}) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    progress = [d for d in data if "prompt_progress" in d]
    assert progress and all(d["type"] == "response.in_progress" for d in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    assert any(d["type"] == "response.output_text.delta" and "timings" in d for d in data)
    # OpenAI's: a reply cut by max_output_tokens ends as response.incomplete (llama-server says completed)
    assert data[-1]["type"] == "response.incomplete" and data[-1]["timings"]["predicted_n"] == 4


def test_several_choices_are_refused_naming_the_field(srv):
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                 "max_tokens": 2, "stream": True, "return_progress": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_progress"


def test_verbose_adds_the_prompt_text_and_counts(srv):
    body = {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "hi"}], "max_tokens": 2}
    with srv.client() as c:
        got = c.post("/chat/completions", json={**body, "verbose": True}).json()
        plain = c.post("/chat/completions", json=body).json()
        streamed = c.post("/chat/completions", json={**body, "verbose": True, "stream": True})
    v = got["__verbose"]
    assert "Book" in v["prompt"] and v["content"] == got["choices"][0]["message"]["content"]
    assert v["tokens_evaluated"] == got["usage"]["prompt_tokens"] and v["tokens_predicted"] == 2
    assert "__verbose" not in plain
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "verbose"


def test_responses_refuse_verbose_they_would_not_apply(srv):
    with srv.client() as c:
        r = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "verbose": True})
        ok = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "verbose": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "verbose"
    assert ok.status_code == 200

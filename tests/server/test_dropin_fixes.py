"""Where cellserve's answers differed from OpenAI's in ways clients notice: Responses ids are `resp_...`; a chat
answer without tool calls has no `tool_calls` field; llama.cpp's `response_format: {"type": "json_object",
"schema": ...}` constrains the output to the schema (it was accepted and ignored); speculative counters leave
OpenAI's Predicted-Outputs fields unless a `prediction` was sent (test_http_speculative.py checks both)."""

import json

import jsonschema
import openai
import pytest
from http_support import LiveServer

from engine.loader.default import DEFAULT_MODEL_DIR

SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}, "age": {"type": "integer",
          "minimum": 0, "maximum": 99}}, "required": ["mood", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def srv():
    with LiveServer(DEFAULT_MODEL_DIR) as server:
        yield server


def test_responses_ids_are_openai_shaped_and_chain(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    first = client.responses.create(model="m", input="Who is Romeo?", max_output_tokens=6, temperature=0)
    assert first.id.startswith("resp_") and "-" not in first.id
    second = client.responses.create(model="m", input="And Juliet?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    assert second.id.startswith("resp_") and client.responses.retrieve(second.id).output_text == second.output_text


def test_a_chat_answer_without_calls_has_no_tool_calls_field(srv):
    with srv.client() as c:
        got = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 5}).json()
    message = got["choices"][0]["message"]
    assert "tool_calls" not in message and message["role"] == "assistant" and message["content"]


def test_json_object_with_a_schema_is_held_to_the_schema(srv):
    body = {"messages": [{"role": "user", "content": "Describe Romeo as JSON."}], "max_tokens": 60,
            "temperature": 0.9, "response_format": {"type": "json_object", "schema": SCHEMA}}
    with srv.client() as c:
        for seed in (1, 2, 3):
            got = c.post("/v1/chat/completions", json={**body, "seed": seed}).json()
            assert got["choices"][0]["finish_reason"] == "stop", got
            jsonschema.validate(json.loads(got["choices"][0]["message"]["content"]), SCHEMA)
        plain = c.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"},
                                                     "seed": 1}).json()["choices"][0]["message"]["content"]
        assert plain.lstrip().startswith("{")  # without a schema: any object, as before
        bad = c.post("/v1/chat/completions", json={**body, "response_format": {"type": "text", "schema": SCHEMA}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
        broken = c.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object",
                                                                                   "schema": {"type": 7}}})
        assert broken.status_code == 400 and "response_format" in broken.json()["error"]["param"]


def test_system_fingerprint_and_chat_input_tokens(srv):
    """Every completion names its build in `system_fingerprint` (a string, as OpenAI documents it; /props says the
    same build); `/chat/completions/input_tokens` counts exactly the prompt tokens the chat route then reports."""
    client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Romeo?"}]
    chat = client.chat.completions.create(model="m", messages=turns, max_tokens=3, temperature=0)
    text = client.completions.create(model="m", prompt="ROMEO:", max_tokens=3, temperature=0)
    with srv.client() as c:
        build = c.get("/props").json()["build_info"]
        assert chat.system_fingerprint == text.system_fingerprint == build and build.startswith("b")
        stream = c.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 2, "stream": True}).text
        assert all(json.loads(line[6:])["system_fingerprint"] == build
                   for line in stream.splitlines() if line.startswith("data: {"))
        for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
            got = c.post(path, json={"messages": turns})
            assert got.status_code == 200 and got.json()["input_tokens"] == chat.usage.prompt_tokens
        assert c.post("/chat/completions/input_tokens", json={"messages": "hi"}).status_code == 400


def test_tuple_items_of_older_json_schema_drafts_are_honoured(srv):
    """`"items": [A, B]` (drafts 4-7's tuple form, which llama.cpp's tests send) constrains each position, as
    2020-12's `prefixItems` does; `additionalItems: false` ends the array there."""
    schema = {"type": "array", "items": [{"type": "integer"}, {"enum": ["Romeo"]}], "additionalItems": False,
              "minItems": 2}
    with srv.client() as c:
        got = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a list"}], "max_tokens": 60,
                                                   "temperature": 0, "response_format": {"type": "json_object",
                                                                                         "schema": schema}})
    assert got.status_code == 200, got.text
    value = json.loads(got.json()["choices"][0]["message"]["content"])
    assert isinstance(value[0], int) and value[1:] == ["Romeo"]

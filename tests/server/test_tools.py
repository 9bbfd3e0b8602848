"""Tool calling (server/chat.py) through a real server over the bundled default model: with a Hermes-style
chat template that renders tools, and with the bundled template that cannot. The toy model has never seen
a tool; `required` and a named `tool_choice` constrain decoding, so its calls are still well-formed and
their arguments valid against each tool's schema."""

import json

import jsonschema
import openai
import pytest
from http_support import LiveServer, sse_events
from tool_support import MESSAGES, SCHEMAS, TIME, TOOLS, assemble, stream_chat

from engine.loader.default import DEFAULT_MODEL_DIR
from server.generation.tools import ToolCallStream, parse_tool_calls


@pytest.fixture(scope="module")
def srv(hermes_dir):
    with LiveServer(hermes_dir, n_cells=4096) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ----- parsing ------------------------------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


def test_parse_whole_text_calls_and_content():
    assert parse_tool_calls("just text") == ("just text", [])
    content, calls = parse_tool_calls(CALL + "\n" + CALL.replace("UTC", "CET"))
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"zone": "UTC"},
                                                                                            {"zone": "CET"}]
    content, calls = parse_tool_calls("Let me check. " + CALL, parallel=False)
    assert content == "Let me check." and len(calls) == 1
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(bad) == (bad, [])
    # a block cut short (max_tokens) is markup, never content
    assert parse_tool_calls("a <tool_call> never closed") == ("a ", [])


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_parsing_equals_whole_parsing_in_any_split(step):
    text = "Sure <tool" + "x> then " + CALL + "\n" + CALL + " done <tool_ca"
    stream = ToolCallStream()
    content, calls = "", []
    for i in range(0, len(text), step):
        c, new = stream.feed(text[i:i + step])
        content, calls = content + c, calls + new
    content += stream.close()
    whole_content, whole_calls = parse_tool_calls(text)
    assert content.strip() == whole_content and [c["function"] for c in calls] == [c["function"] for c in whole_calls]


# ----- through the server -------------------------------------------------------------------------------

def test_required_gives_well_formed_calls_with_finish_reason_tool_calls(client):
    for seed in range(3):
        out = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=100, temperature=1.0, seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        check_calls(choice.message.tool_calls, SCHEMAS)
    # parallel calls allowed: the model decides how many; every complete one is well-formed
    out = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         max_tokens=100, temperature=0.8, seed=9)
    check_calls(out.choices[0].message.tool_calls, SCHEMAS)
    assert out.choices[0].finish_reason in ("tool_calls", "length")


def test_named_function_and_parallel_tool_calls_false(client):
    out = client.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0.9, seed=4,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    check_calls(out.choices[0].message.tool_calls, {"get_weather"})
    assert len(out.choices[0].message.tool_calls) == 1
    single = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=100, temperature=0)
    assert len(single.choices[0].message.tool_calls) == 1 and single.choices[0].finish_reason == "tool_calls"


def test_streamed_tool_calls_arrive_as_argument_deltas(srv):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 100,
            "parallel_tool_calls": False, "temperature": 0}
    deltas, _ = stream_chat(srv, body)
    tool_deltas = [tc for d in deltas for tc in d["delta"].get("tool_calls") or []]
    assert len(tool_deltas) > 2  # the header, then the arguments as they are generated
    calls = assemble(tool_deltas)
    for tc in calls:
        jsonschema.validate(json.loads(tc["function"]["arguments"]), SCHEMAS[tc["function"]["name"]])
    assert not "".join(d["delta"].get("content") or "" for d in deltas)
    assert deltas[-1]["finish_reason"] == "tool_calls"
    with srv.client() as c:
        whole = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert [tc["function"] for tc in whole["message"]["tool_calls"]] == [tc["function"] for tc in calls]


def test_parallel_calls_and_a_call_cut_by_max_tokens_leak_no_markup(srv):
    for max_tokens in (100, 40, 25, 9):
        body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": max_tokens,
                "temperature": 0.9, "seed": 11}
        deltas, _ = stream_chat(srv, body)
        assert not "".join(d["delta"].get("content") or "" for d in deltas)
        calls = assemble([tc for d in deltas for tc in d["delta"].get("tool_calls") or []])
        with srv.client() as c:
            whole = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert whole["message"]["content"] is None
        assert [tc["function"] for tc in whole["message"].get("tool_calls", [])] == [tc["function"] for tc in calls]
        assert deltas[-1]["finish_reason"] == whole["finish_reason"]


def test_auto_without_a_call_is_plain_content_and_none_offers_nothing(client):
    out = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.message.content and not choice.message.tool_calls and choice.finish_reason == "length"
    none = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=12, temperature=0)
    plain = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < out.usage.prompt_tokens  # tools rendered


def test_follow_up_turn_with_tool_calls_and_tool_results(client, srv):
    first = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=100, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    follow = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    out = client.chat.completions.create(model="m", messages=follow, tools=TOOLS[1:], max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")
    with srv.client() as c:  # the template rendered the call (arguments as an object) and the result
        tok = c.post("/tokenize", json={"messages": follow, "return_token_strs": True}).json()
    text = "".join(tok["token_strs"])
    assert "<tool_response>" in text and f'{{"name": "{call.function.name}", "arguments": {{' in text


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": "required"}, "tool_choice"),
])
def test_bad_tool_requests_are_400s(srv, body, param):
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_template_without_tools_speaks_the_generic_format():
    """The bundled template cannot render tools: the tools go in a system message and the reply is a JSON
    call or answer, so auto works too; required is a well-formed call."""
    with LiveServer(str(DEFAULT_MODEL_DIR), n_cells=2048) as server, server.client() as c:
        kinds = set()
        for seed in range(4):
            r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 60,
                                                     "temperature": 1.0, "seed": seed})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            msg = choice["message"]
            assert "tool_call" not in (msg["content"] or "") and '{"response"' not in (msg["content"] or "")
            if choice["finish_reason"] == "tool_calls":  # else a reply, or a call cut by max_tokens
                assert msg["content"] is None and len(msg["tool_calls"]) == 1
                tc = msg["tool_calls"][0]
                jsonschema.validate(json.loads(tc["function"]["arguments"]), SCHEMAS[tc["function"]["name"]])
            kinds.add(choice["finish_reason"])
        assert kinds & {"tool_calls", "stop"}, kinds  # a whole call or a whole answer at least once
        out = c.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 100,
                                                   "tool_choice": "required", "temperature": 0,
                                                   "parallel_tool_calls": False}).json()
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        for tc in choice["message"]["tool_calls"]:
            jsonschema.validate(json.loads(tc["function"]["arguments"]), SCHEMAS[tc["function"]["name"]])
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4,
                                                 "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_n_choices_each_get_their_calls_whole_and_streamed(srv):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "max_tokens": 100, "temperature": 1.0, "seed": 3, "n": 2}
    with srv.client() as c:
        whole = c.post("/v1/chat/completions", json=body).json()["choices"]
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = sse_events(r.iter_lines())
    streamed = {0: [], 1: []}
    for e in events[:-1]:
        for ch in e["choices"]:
            streamed[ch["index"]] += ch["delta"].get("tool_calls") or []
    for choice in whole:
        assert choice["finish_reason"] == "tool_calls"
        calls = choice["message"]["tool_calls"]
        assert [c["function"] for c in calls] == [c["function"] for c in assemble(streamed[choice["index"]])]
        assert calls[0]["function"]["name"] == "get_time"
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), TIME)

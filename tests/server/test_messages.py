"""`/v1/messages` and `/v1/messages/count_tokens` through the `anthropic` SDK against a real server (the bundled
model with a Hermes tool template, behind an API key): text, system blocks with `cache_control`, multi-turn
with cache reads, the event stream, stop sequences, tools round trip (whole and streamed), and errors in
Anthropic's shape."""

import json

import anthropic
import httpx
import jsonschema
import pytest
from http_support import API_KEY, LiveServer, sse_events
from tool_support import SCHEMAS, TEMPLATES, TIME, save_model_dir

from engine.loader.default import DEFAULT_MODEL_DIR

GREEDY = {"temperature": 0}  # sent as extra_body: the SDK no longer types `temperature`
# one tool: the bundled model's context is 512 tokens
TOOLS = [{"name": "get_time", "description": "the time in a zone", "input_schema": TIME,
          "cache_control": {"type": "ephemeral"}}]


@pytest.fixture(scope="module")
def srv(hermes_dir):
    with LiveServer(hermes_dir, n_cells=4096, api_key=API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key=API_KEY, max_retries=0)


def test_text_message(client):
    system = [{"type": "text", "text": "You are brief.", "cache_control": {"type": "ephemeral"}}]
    m = client.messages.create(model="m", max_tokens=12, system=system, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Who is Romeo?"}])
    assert m.type == "message" and m.role == "assistant" and m.model
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 12 and m.usage.cache_creation_input_tokens == 0
    prompt = client.messages.count_tokens(model="m", system=system,
                                          messages=[{"role": "user", "content": "Who is Romeo?"}]).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt
    # the next turn resends the conversation: the prefix cache serves it, counted as cache reads
    turns = [{"role": "user", "content": "Who is Romeo?"}, {"role": "assistant", "content": m.content[0].text},
             {"role": "user", "content": [{"type": "text", "text": "And Juliet?"}]}]
    m2 = client.messages.create(model="m", max_tokens=4, system=system, messages=turns, extra_body=GREEDY)
    assert m2.usage.cache_read_input_tokens >= prompt - 1
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == \
        client.messages.count_tokens(model="m", system=system, messages=turns).input_tokens


def test_stream_text(srv, client):
    kw = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "Speak."}], "extra_body": GREEDY}
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10
    assert client.messages.create(**kw).content[0].text == text  # greedy: the same whole or streamed
    # the raw event sequence, named as Anthropic names it
    raw = {"model": "m", "max_tokens": 10, "messages": kw["messages"], "stream": True, **GREEDY}
    with srv.client() as c, c.stream("POST", "/v1/messages", json=raw) as r:
        lines = list(r.iter_lines())
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    data = sse_events(lines)
    assert [d["type"] for d in data] == names
    assert data[-2]["delta"]["stop_reason"] == "max_tokens" and data[-2]["usage"]["output_tokens"] == 10


def test_stop_sequences(client):
    kw = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Tell me."}], "extra_body": GREEDY}
    text = client.messages.create(**kw).content[0].text
    stop = text[4:7]
    m = client.messages.create(**kw, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]


def test_tools_round_trip(client):
    ask = [{"role": "user", "content": "What time is it in Paris?"}]
    m = client.messages.create(model="m", max_tokens=100, tools=TOOLS, messages=ask, extra_body=GREEDY,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use"
    [call] = [b for b in m.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name in SCHEMAS
    jsonschema.validate(call.input, SCHEMAS[call.name])
    follow = ask + [{"role": "assistant", "content": m.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": [{"type": "text", "text": "noon"}]}]}]
    m2 = client.messages.create(model="m", max_tokens=6, tools=TOOLS, messages=follow, extra_body=GREEDY,
                                tool_choice={"type": "none"})
    assert m2.content[0].type == "text" and m2.stop_reason == "max_tokens"


def test_streamed_tool_use(client):
    with client.messages.stream(model="m", max_tokens=100, tools=TOOLS, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
                                messages=[{"role": "user", "content": "Time?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    [call] = [b for b in final.content if b.type == "tool_use"]
    assert call.name == "get_time" and json.loads("".join(deltas)) == call.input
    jsonschema.validate(call.input, TIME)
    assert final.stop_reason == "tool_use"


def test_errors_have_anthropic_shape(srv, client):
    def check(r, status, kind):
        assert r.status_code == status, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]

    ok = {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    with srv.client() as c:
        check(c.post("/v1/messages", json={"messages": ok["messages"]}), 400, "invalid_request_error")
        check(c.post("/v1/messages", json={**ok, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": ""}}]}]}), 400, "invalid_request_error")
        check(c.post("/v1/messages", json={**ok, "thinking": {"type": "sometimes"}}), 400,
              "invalid_request_error")
        check(c.post("/v1/messages", json={**ok, "tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}),
              400, "invalid_request_error")
        check(c.post("/v1/messages", json={**ok, "max_tokens": 600}), 400, "invalid_request_error")
        check(c.post("/v1/messages", content=b"{not json"), 400, "invalid_request_error")
        check(c.post("/v1/messages", content=b"x" * (9 * 2**20)), 413, "request_too_large")
        check(c.post("/v1/messages/", json=ok), 404, "not_found_error")
        check(c.get("/v1/messages"), 405, "invalid_request_error")
    check(httpx.post(srv.url + "/v1/messages", json=ok), 401, "authentication_error")
    check(httpx.post(srv.url + "/v1/messages", json=ok, headers={"x-api-key": "wrong"}), 401, "authentication_error")
    assert httpx.post(srv.url + "/v1/messages/count_tokens", json=ok,
                      headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="m", max_tokens=600, messages=[{"role": "user", "content": "x"}])
    assert "context" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.count_tokens(
            model="m", messages=[{"role": "user", "content": "x"}])
    # the OpenAI routes keep OpenAI's shape
    with srv.client() as c:
        assert "error" in c.post("/v1/chat/completions", json={}).json()
    assert not srv.app.state.ctx.runs


def streamed_tool_uses(srv, body: dict) -> tuple[list[dict], list[str]]:
    """A raw streamed request: (per tool_use block, its start block and its partial_json deltas in order),
    checking the blocks' order: start, deltas, stop, one block at a time."""
    with srv.client() as c, c.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    uses, current = [], None
    for e in events:
        if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use":
            assert current is None and e["content_block"]["input"] == {}
            current = (e["index"], e["content_block"], [])
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            assert current is not None and e["index"] == current[0]
            current[2].append(e["delta"]["partial_json"])
        elif e["type"] == "content_block_stop" and current is not None and e["index"] == current[0]:
            uses.append({"block": current[1], "deltas": current[2]})
            current = None
    assert current is None
    return uses, [e["type"] for e in events]


@pytest.fixture(scope="module")
def generic():
    """The bundled model's own template, which cannot render tools: the generic call-or-answer format."""
    with LiveServer(str(DEFAULT_MODEL_DIR), n_cells=2048) as server:
        yield server, anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_auto_on_a_template_without_tools_answers_with_a_call(generic):
    srv, client = generic
    ask = [{"role": "user", "content": "What time is it in Paris?"}]
    m = client.messages.create(model="m", max_tokens=60, tools=TOOLS, messages=ask, extra_body=GREEDY)  # auto
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"], m.content
    call = m.content[0]
    assert call.name == "get_time" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, TIME)
    uses, names = streamed_tool_uses(srv, {"model": "m", "max_tokens": 60, "tools": TOOLS, "messages": ask, **GREEDY})
    [use] = uses
    assert use["block"]["name"] == "get_time" and len(use["deltas"]) > 1  # the input as generated
    assert json.loads("".join(use["deltas"])) == call.input
    assert "text_delta" not in json.dumps(names) and names[-2:] == ["message_delta", "message_stop"]
    # the call and its result, sent back, render in the format (a tool result as a user turn)
    follow = ask + [{"role": "assistant", "content": m.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "noon"}]}]
    m2 = client.messages.create(model="m", max_tokens=8, tools=TOOLS, messages=follow, extra_body=GREEDY)
    assert m2.stop_reason in ("tool_use", "end_turn", "max_tokens") and m2.content


@pytest.fixture(scope="module")
def qwen_xml(tmp_path_factory):
    folder = save_model_dir(tmp_path_factory.mktemp("qwen_xml"), TEMPLATES["qwen3_coder"])
    with LiveServer(folder, n_cells=4096) as server:
        yield server, anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_qwen_xml_template_streams_input_json_deltas(qwen_xml):
    srv, client = qwen_xml
    kw = {"model": "m", "max_tokens": 100, "tools": TOOLS, "messages": [{"role": "user", "content": "Time?"}],
          "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    m = client.messages.create(**kw, extra_body=GREEDY)
    [call] = [b for b in m.content if b.type == "tool_use"]
    assert [b.type for b in m.content] == ["tool_use"] and call.name == "get_time"
    jsonschema.validate(call.input, TIME)
    [use], _ = streamed_tool_uses(srv, {**kw, **GREEDY})
    assert use["block"]["name"] == "get_time" and len(use["deltas"]) > 1
    assert json.loads("".join(use["deltas"])) == call.input
    with client.messages.stream(**kw, extra_body=GREEDY) as stream:  # the SDK assembles the same input
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [call.input]
    assert final.stop_reason == m.stop_reason

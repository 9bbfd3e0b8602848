"""`/v1/responses` through the `openai` SDK against a real server: text, the typed stream, stored responses
as persistent sequences (`previous_response_id` appends only the new turn; an older response forks),
retrieve, delete, the 404s, the store bound, tools and `text.format`, and the limits of the other routes."""

import json

import httpx
import jsonschema
import openai
import pytest
from http_support import LiveServer
from tool_support import SCHEMAS, TEMPLATES, TIME, TOOLS, save_model_dir

from engine.loader.default import DEFAULT_MODEL_DIR
from server.limits import Limits

GREEDY = {"temperature": 0, "max_output_tokens": 8}


@pytest.fixture(scope="module")
def srv(model_dir):
    with LiveServer(model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def sequences(srv) -> dict[str, dict]:
    with srv.client() as c:
        return {s["id"]: s for s in c.get("/v1/sequences").json()["data"]}


def seq_of(srv, response_id: str) -> str:
    return srv.app.state.response_store.by_id[response_id].seq_id


def test_text_response(client):
    r = client.responses.create(model="m", input="ROMEO:", **GREEDY)
    assert r.object == "response" and r.id.startswith("resp")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.output_text == item.content[0].text and r.output_text
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_stream_events(client):
    events = list(client.responses.create(model="m", input="JULIET:", stream=True, **GREEDY))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text
    assert final.usage.output_tokens == 8
    assert client.responses.retrieve(final.id).output_text == text
    # the same request, not streamed, says the same (greedy)
    assert client.responses.create(model="m", input="JULIET:", **GREEDY).output_text == text


def test_continue_appends_to_the_same_sequence_without_prefill(srv, client):
    r1 = client.responses.create(model="m", input="Hello there", **GREEDY)
    seq = seq_of(srv, r1.id)
    before = sequences(srv)
    r2 = client.responses.create(model="m", input="And then?", previous_response_id=r1.id, **GREEDY)
    # one sequence holds the whole conversation; every earlier token's cell is reused (all but the
    # reply's last token, which was sampled and never computed)
    assert seq_of(srv, r2.id) == seq and sequences(srv).keys() == before.keys()
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.total_tokens - 1
    assert r2.usage.input_tokens > r1.usage.total_tokens
    assert sequences(srv)[seq]["length"] == r2.usage.total_tokens
    r3 = client.responses.create(model="m", input="Go on.", previous_response_id=r2.id, **GREEDY)
    assert seq_of(srv, r3.id) == seq
    assert r3.usage.input_tokens_details.cached_tokens == r2.usage.total_tokens - 1


def test_older_response_forks(srv, client):
    r1 = client.responses.create(model="m", input="Once upon a time", **GREEDY)
    r2 = client.responses.create(model="m", input="What next?", previous_response_id=r1.id, **GREEDY)
    trunk = seq_of(srv, r1.id)
    # r1 was continued: naming it again branches (a fork at r1's length, sharing its cells)
    r3 = client.responses.create(model="m", input="What next?", previous_response_id=r1.id, **GREEDY)
    branch = seq_of(srv, r3.id)
    info = sequences(srv)[branch]
    assert branch != trunk and info["parent"] == trunk and info["cells"]["shared"] >= r1.usage.total_tokens - 1
    assert r3.usage.input_tokens_details.cached_tokens >= r1.usage.total_tokens - 1
    # the same history and input give the same greedy answer on the branch as on the trunk
    assert r3.output_text == r2.output_text and r3.usage.input_tokens == r2.usage.input_tokens
    # both tips still continue in place
    r4 = client.responses.create(model="m", input="More.", previous_response_id=r2.id, **GREEDY)
    r5 = client.responses.create(model="m", input="More.", previous_response_id=r3.id, **GREEDY)
    assert seq_of(srv, r4.id) == trunk and seq_of(srv, r5.id) == branch


def test_store_false_and_delete(srv, client):
    baseline = sequences(srv).keys()
    r = client.responses.create(model="m", input="Not kept", store=False, **GREEDY)
    assert r.store is False and r.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    r1 = client.responses.create(model="m", input="Kept", **GREEDY)
    r2 = client.responses.create(model="m", input="Not kept either", store=False, previous_response_id=r1.id,
                                 **GREEDY)
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.total_tokens - 1
    assert sequences(srv).keys() - baseline == {seq_of(srv, r1.id)}  # the store=false fork is gone
    client.responses.delete(r1.id)
    assert sequences(srv).keys() == baseline  # no stored response on it: the sequence is deleted
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(r1.id)
    assert err.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="m", input="x", previous_response_id=r1.id, **GREEDY)
    assert err.value.body["code"] == "previous_response_not_found"
    assert err.value.body["param"] == "previous_response_id"


def test_expired_sequence_is_a_clear_404(srv, client):
    r = client.responses.create(model="m", input="Soon gone", **GREEDY)
    with srv.client() as c:  # what --seq-ttl does to an idle sequence
        c.delete(f"/v1/sequences/{seq_of(srv, r.id)}").raise_for_status()
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="m", input="x", previous_response_id=r.id, **GREEDY)
    assert err.value.body["code"] == "previous_response_not_found" and "expired" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_dropped_stream_leaves_nothing(srv, client):
    baseline = sequences(srv).keys()
    r1 = client.responses.create(model="m", input="Begin", **GREEDY)
    used = srv.wait_idle()["cells"]["used"]
    talk = {"model": "m", "input": "Talk", "max_output_tokens": 400, "temperature": 0}
    for prev in (None, r1.id):  # a new sequence, and an append to r1's tip
        # Greedy runs the whole 400 tokens here, so the drop below always cuts a running turn short (a
        # sampled turn could end on EOS before the server notices the client left: stored, rightly).
        assert client.responses.create(**talk, previous_response_id=prev, store=False).status == "incomplete"
        with client.responses.create(**talk, stream=True, previous_response_id=prev) as stream:
            for event in stream:
                if event.type == "response.output_text.delta":
                    break
    srv.wait_idle()
    assert srv.wait_cells_used(used, timeout=5) <= used
    assert sequences(srv).keys() - baseline == {seq_of(srv, r1.id)}
    # r1 is its sequence's tip again: the next turn appends in place
    r2 = client.responses.create(model="m", input="Again", previous_response_id=r1.id, **GREEDY)
    assert seq_of(srv, r2.id) == seq_of(srv, r1.id)
    # every token of r1 is cached (>=: run again in one server, an earlier run's identical turns match further)
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.total_tokens - 1


def test_store_is_bounded(model_dir):
    with LiveServer(model_dir, limits=Limits(max_stored_responses=2)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        ids = [client.responses.create(model="m", input=f"turn {k}", **GREEDY).id for k in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
        assert len(sequences(srv)) == 2  # the forgotten response's sequence was deleted


def test_input_items_listed_and_paginated(srv, client):
    items = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"type": "message", "id": "msg_mine", "role": "assistant", "content": "Hello"},
             {"role": "user", "content": [{"type": "input_text", "text": "Who?"}]}]
    r = client.responses.create(model="m", input=items, **GREEDY)
    newest_first = list(client.responses.input_items.list(r.id, limit=3))  # the SDK follows after= pages
    assert [(i.role, i.content[0].text) for i in newest_first] == [
        ("user", "Who?"), ("assistant", "Hello"), ("user", "Hi"), ("developer", "Be brief.")]
    assert newest_first[1].id == "msg_mine" and newest_first[1].content[0].type == "output_text"
    assert newest_first[0].content[0].type == "input_text" and len({i.id for i in newest_first}) == 4
    first = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in first.data] == ["Be brief.", "Hi"] and first.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=first.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["Hello", "Who?"] and not rest.has_more
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_items.list(r.id, after="nope")
    assert err.value.body["param"] == "after"
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(r.id, limit=101)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_missing")


def test_refused_and_invalid_requests(srv, client):
    cases = [({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
             ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
             ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0]"),
             ({"input": "x", "tool_choice": "required"}, "tool_choice"),
             ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
             ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
             ({"input": "x" * 5000, "max_output_tokens": 8}, None)]
    with srv.client() as c:
        for body, param in cases:
            r = c.post("/v1/responses", json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error"
            assert param is None or err["param"].startswith(param), err
        r = c.post("/v1/responses", json={"input": "hi " * 400, "max_output_tokens": 400})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert c.post("/v1/responses", content=b"x" * (9 * 2**20)).status_code == 413
    assert not srv.app.state.ctx.runs


@pytest.fixture(scope="module")
def hermes(hermes_dir):
    with LiveServer(hermes_dir, n_cells=4096) as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_tools_and_function_call_outputs(hermes):
    srv, client = hermes
    time_tool = RESPONSE_TOOLS[1:]  # the bundled model's context is 512 tokens: one tool keeps turns short
    r1 = client.responses.create(model="m", input="Time?", tools=time_tool, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=100, temperature=0)
    calls = [item for item in r1.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    # the tool's answer continues the stored response (the same tools rendered): appended to its sequence
    r2 = client.responses.create(model="m", previous_response_id=r1.id, tools=time_tool, max_output_tokens=8,
                                 input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                         "output": "sunny"}], temperature=0)
    assert seq_of(srv, r2.id) == seq_of(srv, r1.id)
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.total_tokens - 1
    # the same conversation sent whole as items (no stored state) renders through the same template
    r3 = client.responses.create(model="m", store=False, tools=RESPONSE_TOOLS, tool_choice="none", max_output_tokens=8,
                                 temperature=0, input=[
                                     {"role": "developer", "content": "Answer briefly."},
                                     {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                                     {"type": "function_call", "call_id": "call_1", "name": "get_time",
                                      "arguments": '{"zone": "UTC"}'},
                                     {"type": "function_call_output", "call_id": "call_1", "output": "noon"}])
    assert r3.output[0].type == "message"


def test_streamed_function_call(hermes):
    _, client = hermes
    events = list(client.responses.create(model="m", input="Time?", tools=RESPONSE_TOOLS, stream=True,
                                          tool_choice={"type": "function", "name": "get_time"},
                                          max_output_tokens=100, temperature=0))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert len(done) == 1 and done[0].name == "get_time"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == json.loads(done[0].arguments) and json.loads(args)["zone"] in ("UTC", "CET")
    assert events[-1].type == "response.completed"


def test_text_format_json_schema(hermes):
    _, client = hermes
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "zone": {"enum": ["UTC", "CET"]}},
              "required": ["ok", "zone"], "additionalProperties": False}
    r = client.responses.create(model="m", input="JSON please", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.status == "completed" and r.text.format.type == "json_schema"


def streamed_calls(events) -> list[tuple[str, str, int]]:
    """(name, arguments joined from the deltas, number of deltas) per streamed function_call item, checking
    the order of its events: added (no arguments yet), deltas, arguments.done, item done."""
    out, open_items = [], {}
    for e in events:
        if e.type == "response.output_item.added" and e.item.type == "function_call":
            assert e.item.arguments == "" and e.item.call_id.startswith("call_")
            open_items[e.item.id] = []
        elif e.type == "response.function_call_arguments.delta":
            open_items[e.item_id].append(e.delta)
        elif e.type == "response.function_call_arguments.done":
            assert "".join(open_items[e.item_id]) == e.arguments
        elif e.type == "response.output_item.done" and e.item.type == "function_call":
            deltas = open_items.pop(e.item.id)
            assert "".join(deltas) == e.item.arguments and e.item.status == "completed"
            out.append((e.item.name, e.item.arguments, len(deltas)))
    assert not open_items
    return out


@pytest.fixture(scope="module")
def generic():
    """The bundled model's own template, which cannot render tools: the generic call-or-answer format."""
    with LiveServer(str(DEFAULT_MODEL_DIR), n_cells=2048) as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_auto_on_a_template_without_tools_answers_with_a_call(generic):
    srv, client = generic
    kw = {"model": "m", "input": "What time is it in Paris?", "tools": RESPONSE_TOOLS[1:], "temperature": 0,
          "max_output_tokens": 60}
    r = client.responses.create(**kw)  # tool_choice auto (the default): a 400 before the generic format
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"], r.output
    call = r.output[0]
    assert call.name == "get_time" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), TIME)
    # streamed: the arguments arrive as deltas that reassemble to the same call (greedy)
    events = list(client.responses.create(**kw, stream=True))
    [(name, arguments, n)] = streamed_calls(events)
    assert (name, json.loads(arguments)) == (call.name, json.loads(call.arguments)) and n > 1
    assert not [e for e in events if e.type == "response.output_text.delta"]  # no JSON markup as text
    assert events[-1].type == "response.completed"
    # the tool's output continues the stored response (the call and its result rendered as the format says)
    r2 = client.responses.create(model="m", previous_response_id=r.id, tools=RESPONSE_TOOLS[1:], temperature=0,
                                 max_output_tokens=8, input=[{"type": "function_call_output",
                                                              "call_id": call.call_id, "output": "noon"}])
    assert r2.status in ("completed", "incomplete") and r2.output
    # auto there is a constrained JSON reply: a structured output format would contradict it
    with srv.client() as c:
        bad = c.post("/v1/responses", json={"input": "x", "tools": RESPONSE_TOOLS, "max_output_tokens": 8,
                                            "text": {"format": {"type": "json_object"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools", bad.text


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    folder = save_model_dir(tmp_path_factory.mktemp("llama3"), TEMPLATES["llama3_json"])
    with LiveServer(folder, n_cells=4096) as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_llama3_template_calls_with_streamed_argument_deltas(llama3):
    _, client = llama3
    kw = {"model": "m", "input": "Time?", "tools": RESPONSE_TOOLS, "tool_choice": "required",
          "parallel_tool_calls": False, "max_output_tokens": 100, "temperature": 0}
    r = client.responses.create(**kw)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and [item.type for item in r.output] == ["function_call"], r.output
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    events = list(client.responses.create(**kw, stream=True))
    [(name, arguments, n)] = streamed_calls(events)
    assert (name, arguments) == (calls[0].name, calls[0].arguments) and n > 1  # as generated, not whole
    assert events[-1].type == "response.completed"
    assert [i.type for i in events[-1].response.output] == ["function_call"]
    # auto: free text here, with no call markup
    text = client.responses.create(model="m", input="Time?", tools=RESPONSE_TOOLS, max_output_tokens=12,
                                   temperature=0)
    assert text.output_text and "<|python_tag|>" not in text.output_text


def test_api_key(model_dir):
    with LiveServer(model_dir, api_key="sk-k") as srv:
        assert httpx.post(srv.url + "/v1/responses", json={"input": "x"}).status_code == 401
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-k", max_retries=0)
        assert ok.responses.create(model="m", input="x", **GREEDY).output_text

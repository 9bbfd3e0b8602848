"""Structured output (engine/sample/grammar.py + the Sampler's mask hook) with the bundled default model, whose
text is otherwise never JSON: every finished output parses and validates against its schema, ends with
finish_reason "stop" when the grammar is complete, shares batches with free rows without changing them,
and every way of asking for it over HTTP works (chat, completions, sequences, stream, the openai SDK's
`parse`); what cannot be compiled or honoured is a 400 naming the field."""

import json
import re

import jsonschema
import openai
import pydantic
import pytest
from http_support import LiveServer, sse_events

from engine.api.sampling_params import GuidedDecoding, SamplingError, SamplingParams
from engine.core.llm import LLM
from engine.loader.default import DEFAULT_MODEL_DIR

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "angry"]},
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "mood", "friends"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe Romeo as JSON."}]


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL_DIR, dtype="float32")  # as LiveServer serves it (tests/http_support.py)


def gen(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_free_text_of_the_bundled_model_is_not_json(llm):
    out = gen(llm, ["ROMEO:"], SamplingParams(max_tokens=30, temperature=0))[0]
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_json_schema_output_validates_and_ends_with_stop(llm):
    guided = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=120, temperature=t, seed=s, guided=guided)
              for t, s in ((0, None), (0.8, 1), (1.0, 2), (1.2, 3))]
    outs = gen(llm, ["ROMEO:", "JULIET:", "Enter", "Hello"], params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_constrained_and_free_rows_share_a_batch_without_changing_the_free_ones(llm):
    free = SamplingParams(max_tokens=20, temperature=0)
    alone = gen(llm, ["ROMEO:"], free)[0]
    guided = SamplingParams(max_tokens=80, temperature=0, guided=GuidedDecoding("json_schema", json.dumps(SCHEMA)))
    mixed = gen(llm, ["JULIET:", "ROMEO:"], [guided, free])
    assert mixed[1].token_ids == alone.token_ids
    jsonschema.validate(json.loads(mixed[0].text), SCHEMA)


def test_choice_regex_grammar_and_json_object(llm):
    choice = gen(llm, ["Q:"] * 3, [SamplingParams(max_tokens=10, temperature=1.0, seed=s,
                                                   guided=GuidedDecoding("choice", choices=("yes", "no", "maybe")))
                                    for s in range(3)])
    assert all(o.text in ("yes", "no", "maybe") and o.finish_reason == "stop" for o in choice)
    regex = gen(llm, ["Q:"], SamplingParams(max_tokens=20, temperature=0.7, seed=0,
                                            guided=GuidedDecoding("regex", r"\d{3}-[a-z]{2,5}")))[0]
    assert re.fullmatch(r"\d{3}-[a-z]{2,5}", regex.text) and regex.finish_reason == "stop"
    ebnf = 'root ::= "ROMEO" ": " ("yes" | "no") "."'
    g = gen(llm, ["Q:"], SamplingParams(max_tokens=20, temperature=0, guided=GuidedDecoding("grammar", ebnf)))[0]
    assert g.text in ("ROMEO: yes.", "ROMEO: no.") and g.finish_reason == "stop"
    obj = gen(llm, ["{"], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True,
                                         guided=GuidedDecoding("json_object")))[0]
    if obj.finish_reason == "stop":  # the toy model may never close a free-form string: then "length"
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{") and obj.finish_reason == "length"


def test_n_choices_each_follow_the_grammar(llm):
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=7, n=3,
                            guided=GuidedDecoding("json_schema", json.dumps(SCHEMA)))
    outs = llm.generate(["ROMEO:"], params, use_tqdm=False)[0].outputs
    assert len(outs) == 3
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_guided_decoding_fields_are_validated():
    with pytest.raises(SamplingError):
        GuidedDecoding("yaml", "x")
    with pytest.raises(SamplingError):
        GuidedDecoding("choice", choices=())
    with pytest.raises(SamplingError):
        GuidedDecoding("regex", "")


# ----- over HTTP -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv():
    with LiveServer(str(DEFAULT_MODEL_DIR), n_cells=4096) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def rf(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_chat_completions_and_sequences_honour_response_format(srv):
    with srv.client() as c:
        chat = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 120, "temperature": 0.9,
                                                    "seed": 3, "response_format": rf()}).json()
        msg = chat["choices"][0]
        assert msg["finish_reason"] == "stop"
        jsonschema.validate(json.loads(msg["message"]["content"]), SCHEMA)
        cmpl = c.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 120, "temperature": 0,
                                               "guided_json": SCHEMA}).json()
        jsonschema.validate(json.loads(cmpl["choices"][0]["text"]), SCHEMA)
        seq = c.post("/v1/sequences", json={"prompt": "JULIET:"}).json()
        out = c.post(f"/v1/sequences/{seq['id']}/completions",
                     json={"max_tokens": 120, "temperature": 0, "response_format": rf()}).json()
        jsonschema.validate(json.loads(out["choices"][0]["text"]), SCHEMA)
        # the sequence keeps the JSON; a free continuation after it is unconstrained again
        free = c.post(f"/v1/sequences/{seq['id']}/completions", json={"max_tokens": 5, "temperature": 0}).json()
        assert free["choices"][0]["finish_reason"] in ("length", "stop")
        obj = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, "temperature": 0,
                                                   "response_format": {"type": "json_object"}}).json()
        assert obj["choices"][0]["message"]["content"].startswith("{")
        text = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3,
                                                    "response_format": {"type": "text"}})
        assert text.status_code == 200


def test_streamed_structured_output_concatenates_to_valid_json(srv):
    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 120, "temperature": 0, "stream": True,
            "response_format": rf()}) as r:
        events = sse_events(r.iter_lines())
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"


def test_vllm_guided_extras(srv):
    with srv.client() as c:
        def text(**kw):
            body = {"prompt": "Q:", "max_tokens": 20, "temperature": 0.8, "seed": 1, **kw}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        assert text(guided_choice=["Montague", "Capulet"]) in ("Montague", "Capulet")
        assert re.fullmatch(r"[A-Z][a-z]{3,6}!", text(guided_regex=r"[A-Z][a-z]{3,6}!"))
        assert text(guided_grammar='root ::= "to be" | "not to be"') in ("to be", "not to be")
        assert text(guided_json=json.dumps({"type": "boolean"}), guided_decoding_backend="xgrammar") in \
            ("true", "false")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


def test_openai_sdk_parse_with_a_pydantic_model(client):
    out = client.chat.completions.parse(model="m", messages=MESSAGES, response_format=Person, max_tokens=80,
                                        temperature=0)
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": rf({"type": "object", "properties": {"a": {"type": "strin"}}})}, "response_format",
     "strin"),
    ({"response_format": rf({"type": "object", "required": 5})}, "response_format", "required"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"guided_regex": "(ab"}, "guided_regex", "parenthesis"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    ({"guided_json": "{not json"}, "guided_json", "JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"min_tokens": 5}, "min_tokens", "max_tokens"),  # min_tokens is honoured, but never beyond max_tokens
    ({"use_beam_search": True}, "use_beam_search", "not supported"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(srv, body, param, words):
    with srv.client() as c:
        for route, base in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})):
            r = c.post(route, json={**base, "max_tokens": 4, **body})
            assert r.status_code == 400, (route, r.text)
            err = r.json()["error"]
            assert err["param"] == param and words.lower() in err["message"].lower(), err
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "best_of": 1, "skip_special_tokens": True,
                                             "user": "u", "metadata": {"k": "v"}, "store": False})
        assert ok.status_code == 200, ok.text
    assert srv.wait_idle()["requests"]["running"] == 0


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
    ("/v1/completions", {"prompt": "x", "max_completion_tokens": 3}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "echo": True}, "echo"),
])
def test_a_field_of_another_route_is_a_400_too(srv, route, body, param):
    with srv.client() as c:
        r = c.post(route, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def heavy_schema(n: int) -> dict:
    """A schema xgrammar takes a long while to compile (seconds at n=300 on SmolLM2's vocabulary)."""
    props = {f"p{i}": {"type": "string", "pattern": "[a-z]{3,300}"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def test_a_grammar_that_compiles_too_long_is_a_400_in_bounded_time_and_stalls_nothing():
    """#30: a pathological schema costs its client a 400 after grammar_timeout_s, never the engine's tick:
    plain requests sent meanwhile are served; the compile goes on in the background and is cached."""
    import concurrent.futures
    import time

    with LiveServer(str(DEFAULT_MODEL_DIR), n_cells=1024, grammar_timeout_s=0.2) as srv, srv.client() as c:
        fmt = {"type": "json_schema", "json_schema": {"name": "heavy", "schema": heavy_schema(200)}}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": fmt}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            t = time.monotonic()
            heavy = pool.submit(c.post, "/v1/chat/completions", json=body)
            time.sleep(0.05)
            plain = c.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4})
            r = heavy.result()
            took = time.monotonic() - t
        assert plain.status_code == 200
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "response_format" and "did not compile within 0.2 s" in \
            err["message"], r.text
        assert took < 5  # the timeout, not the compile (which runs on, several seconds)

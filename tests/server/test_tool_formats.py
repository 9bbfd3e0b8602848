"""Tool-call formats chosen from the chat template (server/openai/tool_formats): each format's parser on
text in every split (streamed argument deltas reassemble to the whole call, markup never reaches the
content), and each format end to end through a real server over the bundled model saved with that
format's template: `required`, a named choice and `auto` constrain decoding to the format's calls."""

import json

import jsonschema
import pytest
from http_support import LiveServer
from tool_support import MESSAGES, SCHEMAS, TEMPLATES, TOOLS, assemble, save_model_dir, stream_chat

from server.generation.constraints import Tool
from server.generation.tools import FORMATS, format_for, parse_tool_calls, tool_parser

TOOL_OBJS = [Tool.model_validate(t) for t in TOOLS]

# (format, text, content, [(name, arguments)])
CASES = [
    ("hermes", ('Hi <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>\n'
               '{"arguments": {"city": "a}b\\"", "unit": "celsius"}, "name": "get_weather"}\n</tool_call>\n'),
     "Hi", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": 'a}b"', "unit": "celsius"})]),
    ("llama3_json", ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}'),
     None, [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Rome", "unit": "celsius"})]),
    ("llama3_json", 'Let me see. {"name": "get_time", "parameters": {"zone": "CET"}}', "Let me see.",
     [("get_time", {"zone": "CET"})]),
    ("mistral", ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
                '{"name": "get_weather", "arguments": {"city": "[x]", "unit": "fahrenheit"}}]'),
     None, [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "[x]", "unit": "fahrenheit"})]),
    ("mistral", 'Sure. [{"name": "get_time", "arguments": {"zone": "UTC"}}]', "Sure.", [("get_time", {"zone": "UTC"})]),
    ("qwen3_coder", ('Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n'
                    '<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>'),
     "Checking.", [("get_weather", {"city": "New\nYork", "unit": "celsius"})]),
    ("generic", '{"tool_call": {"name": "get_time", "arguments": {"zone": "UTC"}}}', None, [("get_time", {"zone": "UTC"})]),
    ("generic", '{"response": "Caf\\u00e9 \\"ok\\"\\nbye"}', 'Café "ok"\nbye', []),
]


def run_stream(parser, text: str, step: int) -> tuple[str, list[dict]]:
    content, deltas = "", []
    for i in range(0, len(text), step):
        c, d = parser.feed(text[i:i + step])
        content, deltas = content + c, deltas + d
    c, d = parser.close()
    return content + c, deltas + d


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_each_format_parses_whole_and_streamed_alike(fmt, text, content, calls, step):
    whole_content, whole = FORMATS[fmt].new_parser(TOOL_OBJS).parse(text)
    assert whole_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == calls
    streamed_content, deltas = run_stream(FORMATS[fmt].new_parser(TOOL_OBJS), text, step)
    assert [c["function"] for c in assemble(deltas)] == [c["function"] for c in whole]
    assert streamed_content.strip() == (content or "")


@pytest.mark.parametrize("fmt, text", [
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_c'),
    ("hermes", '<tool_call>\n{"name": "get_time", "argu'),
    ("llama3_json", '{"name": "get_time", "parameters": {"zo'),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, {"na'),
    ("qwen3_coder", '<tool_call>\n<function=get_time>\n<parameter=zone>\nU'),
])
@pytest.mark.parametrize("forced", [False, True])
def test_a_call_cut_short_leaks_no_markup(fmt, text, forced):
    for step in (1, 3, 1000):
        content, deltas = run_stream(FORMATS[fmt].new_parser(TOOL_OBJS, forced=forced), text, step)
        assert content == "", content
        calls = assemble(deltas)
        assert calls and calls[0]["function"]["name"] == "get_time"


def test_parallel_false_keeps_only_the_first_call():
    text = ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, deltas = run_stream(tool_parser(parallel=False), text, 3)
    assert content == "" and [json.loads(c["function"]["arguments"]) for c in assemble(deltas)] == [{"zone": "UTC"}]
    assert len(parse_tool_calls(text, parallel=False)[1]) == 1


def test_format_is_chosen_from_the_template():
    assert {name: format_for(t).name for name, t in TEMPLATES.items()} == {
        "hermes": "hermes", "llama3_json": "llama3_json", "mistral": "mistral", "qwen3_coder": "qwen3_coder",
        "think": "generic"}
    assert format_for(None).name == "generic"


# ----- through a server, one per format -------------------------------------------------------------------

BUDGET = {"llama3_json": 100, "mistral": 100, "qwen3_coder": None}  # None: what the 512-token context leaves


@pytest.fixture(scope="module", params=["llama3_json", "mistral", "qwen3_coder"])
def fmt_srv(request, tmp_path_factory):
    folder = save_model_dir(tmp_path_factory.mktemp(request.param), TEMPLATES[request.param])
    with LiveServer(folder, n_cells=4096) as server:
        yield request.param, server


def test_required_named_and_auto_in_each_format(fmt_srv):
    fmt, srv = fmt_srv
    tools = TOOLS[1:] if fmt == "qwen3_coder" else TOOLS  # XML markup is long in the toy model's tokens
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        body = {"messages": MESSAGES, "tools": tools, "tool_choice": choice, "max_tokens": BUDGET[fmt],
                "temperature": 0, "parallel_tool_calls": False}
        with srv.client() as c:
            whole = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert whole["finish_reason"] == "tool_calls", (fmt, whole)
        assert whole["message"]["content"] is None
        for tc in whole["message"]["tool_calls"]:
            jsonschema.validate(json.loads(tc["function"]["arguments"]), SCHEMAS[tc["function"]["name"]])
        if isinstance(choice, dict):
            assert [tc["function"]["name"] for tc in whole["message"]["tool_calls"]] == ["get_time"]
        deltas, _ = stream_chat(srv, body)
        calls = assemble([tc for d in deltas for tc in d["delta"].get("tool_calls") or []])
        assert [tc["function"] for tc in calls] == [tc["function"] for tc in whole["message"]["tool_calls"]]
        assert not "".join(d["delta"].get("content") or "" for d in deltas)
        assert deltas[-1]["finish_reason"] == "tool_calls"
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 16, "temperature": 0}  # auto: free text here
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]

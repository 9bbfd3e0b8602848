"""Tool-calling fixtures shared by the server tests: two tools with strict schemas and a Hermes /
Qwen2.5-style chat template (ChatML turns, tools in the system turn, <tool_call> blocks, tool turns)
that the bundled model's folder is saved with, so tools render through the template."""

import shutil
from pathlib import Path

from engine.loader.default import DEFAULT_MODEL_DIR

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Verona?"}]

HERMES = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
For each call return <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


LLAMA3 = """{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{% if m.role == 'user' and tools and loop.last %}Reply {"name": function name, "parameters": its arguments}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}{% if m.tool_calls %}<|python_tag|>{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", \
"parameters": {{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>\
{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{%- for m in messages %}\
{% if m.role == 'user' %}[INST] {{ m.content }}[/INST]{% elif m.tool_calls %}[TOOL_CALLS]\
{{ m.tool_calls | map(attribute='function') | list | tojson }}</s>{% elif m.role == 'tool' %}[TOOL_RESULTS]\
{{ m.content }}[/TOOL_RESULTS]{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"""

QWEN_XML = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
Call: <tool_call>
<function=f>
<parameter=p>
v
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Qwen3-style thinking switch: the generation prompt opens <think> unless enable_thinking is false.
THINK = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA3, "mistral": MISTRAL, "qwen3_coder": QWEN_XML, "think": THINK}


def save_model_dir(path: Path, template: str) -> str:
    """The bundled model's folder with `template` in place of its own chat template."""
    for f in DEFAULT_MODEL_DIR.iterdir():
        if f.is_file() and f.name != "chat_template.jinja":
            shutil.copy(f, path / f.name)
    (path / "chat_template.jinja").write_text(template)
    return str(path)


def save_hermes_model_dir(path: Path) -> str:
    """The bundled model's folder with the Hermes template in place of its own."""
    return save_model_dir(path, HERMES)


def assemble(tool_deltas: list[dict]) -> list[dict]:
    """Streamed `delta.tool_calls` entries -> whole calls, checking OpenAI's shape on the way: a call's
    first delta has id, type, name and `"arguments": ""`; later ones only argument fragments."""
    calls: dict[int, dict] = {}
    for d in tool_deltas:
        if d["index"] not in calls:
            assert d["id"].startswith("call_") and d["type"] == "function", d
            assert d["function"]["name"] and d["function"]["arguments"] == "", d
            calls[d["index"]] = {"id": d["id"], "type": "function", "function": dict(d["function"])}
        else:
            assert "id" not in d and set(d["function"]) == {"arguments"}, d
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


def stream_chat(srv, body: dict) -> tuple[list[dict], list]:
    """POST a streamed chat request: (its choice-0 deltas, all events)."""
    from http_support import sse_events

    with srv.client() as c, c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return [e["choices"][0] for e in events[:-1] if e["choices"]], events

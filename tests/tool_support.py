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


def save_hermes_model_dir(path: Path) -> str:
    """The bundled model's folder with the Hermes template in place of its own."""
    for f in DEFAULT_MODEL_DIR.iterdir():
        if f.is_file() and f.name != "chat_template.jinja":
            shutil.copy(f, path / f.name)
    (path / "chat_template.jinja").write_text(HERMES)
    return str(path)

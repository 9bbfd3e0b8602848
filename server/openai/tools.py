"""Tool calling: tools into the prompt through the model's chat template, decoding constrained to
well-formed calls, and the model's calls out of its text (whole or streamed).

The call format is Hermes/ChatML's (Qwen2.5, Hermes, SmolLM3 and most open chat models trained for
tools): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.

Guarantees:
- `tool_choice` "required" or a named function constrains decoding (an xgrammar structural tag built
  here from the tools' JSON schemas) so the output *is* one or more well-formed calls of the allowed
  functions with schema-valid arguments, whatever the model; "auto" constrains only what follows a
  `<tool_call>` the model chose to open; "none" renders no tools and parses nothing.
- `parse_tool_calls` and `ToolCallStream` agree: the same text gives the same calls and content,
  whole or streamed in any split. A block that is not a valid call stays in the content, as text.
- Torch-free: the grammar leaves here as JSON text (`engine.api.sampling_params.GuidedDecoding` fields).
"""

import json
import uuid

START, END = "<tool_call>", "</tool_call>"


def supports_tools(chat_template) -> bool:
    """Whether a chat template renders `tools` (HF templates that do reference the variable)."""
    if isinstance(chat_template, dict):
        return any(supports_tools(t) for t in chat_template.values())
    return isinstance(chat_template, str) and "tools" in chat_template


def template_tools(tools: list) -> list[dict]:
    """The `tools=` argument of `apply_chat_template`: OpenAI's `{"type": "function", "function": {...}}`."""
    return [{"type": "function", "function": t.function.as_dict()} for t in tools]


def call_grammar(tools: list, choice: str | None, *, parallel: bool, triggered: bool) -> dict:
    """GuidedDecoding fields constraining the output to calls of `tools` (or only of `choice`, by name).

    triggered=False (required/named): the output is calls only, at least one. triggered=True (auto):
    free text, and whatever follows a `<tool_call>` the model opens is a valid call."""
    allowed = [t for t in tools if choice is None or t.function.name == choice]
    tags = [{"type": "tag", "begin": f'{START}\n{{"name": {json.dumps(t.function.name)}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": t.function.parameters or {"type": "object"},
                         "max_whitespace_cnt": 1},
             "end": f"}}\n{END}"} for t in allowed]
    if triggered:
        fmt = {"type": "triggered_tags", "triggers": [START], "tags": tags, "at_least_one": False,
               "stop_after_first": not parallel}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": not parallel or choice is not None}
    return {"kind": "structural_tag", "spec": json.dumps({"type": "structural_tag", "format": fmt}),
            "param": "tool_choice" if not triggered else "tools"}


def _call(block: str) -> dict | None:
    """One `<tool_call>` body -> an OpenAI tool call, or None if it is not `{"name": str, "arguments": ...}`."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolCallStream:
    """Splits streamed text into content and tool calls. `feed(text)` -> (content delta, new calls);
    `close()` flushes what is held back (a partial `<tool_call>` prefix or an unclosed block, as text).

    Content is held back only while it could be the start of `<tool_call>`, so plain text streams as it
    comes. With `parallel` false only the first call is kept (later blocks are dropped)."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.pending = ""  # text not yet classified
        self.in_call = False
        self.calls: list[dict] = []
        self.content = ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        out, new = "", []
        while True:
            if self.in_call:
                end = self.pending.find(END)
                if end < 0:
                    break
                block, self.pending = self.pending[:end], self.pending[end + len(END):]
                self.in_call = False
                call = _call(block.strip())
                if call is None:
                    out += START + block + END
                elif self.parallel or not self.calls:
                    self.calls.append(call)
                    new.append(call)
                continue
            start = self.pending.find(START)
            if start >= 0:
                out += self.pending[:start]
                self.pending = self.pending[start + len(START):]
                self.in_call = True
                continue
            keep = _partial_suffix(self.pending, START)
            out += self.pending[: len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep:]
            break
        self.content += out
        return out, new

    def close(self) -> str:
        rest = (START if self.in_call else "") + self.pending
        self.pending, self.in_call = "", False
        self.content += rest
        return rest


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """Whole text -> (content, or None when it is only calls and whitespace; calls)."""
    stream = ToolCallStream(parallel)
    stream.feed(text)
    stream.close()
    content = stream.content
    if stream.calls and not content.strip():
        return None, stream.calls
    return content.strip() if stream.calls else content, stream.calls

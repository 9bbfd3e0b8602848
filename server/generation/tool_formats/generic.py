"""The generic format, for chat templates that cannot render tools (llama.cpp's idea): the tools are
described in a system message and the reply is constrained to one JSON object that is either
`{"tool_call": {"name": ..., "arguments": {...}}}` or `{"response": "..."}` (required/named: only the
former). The parser turns it back into a tool call, or streams the response string as content."""

import json
import re

from server.generation.tool_formats.base import Block, JsonCall, ToolParser
from server.generation.tool_formats.grammar import allowed, parameters

HEAD = re.compile(r'\s*\{\s*"(tool_call|response)"\s*:\s*')

INSTRUCTIONS = ("You can call the tools below. Reply with one JSON object: either {\"tool_call\": {\"name\": "
                "<tool name>, \"arguments\": <the arguments as a JSON object>}} to call a tool, or "
                "{\"response\": <your answer as a string>} to answer directly.")
FORCED_INSTRUCTIONS = ("Call one of the tools below. Reply with one JSON object: {\"tool_call\": {\"name\": "
                       "<tool name>, \"arguments\": <the arguments as a JSON object>}}.")


def generic_system_prompt(tools: list, forced: bool) -> str:
    listed = "\n".join(json.dumps(t.function.as_dict(), ensure_ascii=False) for t in tools)
    return (FORCED_INSTRUCTIONS if forced else INSTRUCTIONS) + "\n\nTools:\n" + listed


def generic_messages(messages: list[dict], tools: list, forced: bool) -> list[dict]:
    """Chat messages for a template without tool support: the tools in the system message, earlier calls
    as the assistant's JSON replies and tool results as user turns."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m.pop("tool_calls")]
            m["content"] = json.dumps({"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls},
                                      ensure_ascii=False)
        if m["role"] in ("tool", "function"):
            m = {"role": "user", "content": f"Tool result ({m.get('name') or m.get('tool_call_id') or 'tool'}): "
                                            f"{m.get('content') or ''}"}
        out.append(m)
    prompt = generic_system_prompt(tools, forced)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def generic_schema(tools: list, choice: str | None, forced: bool) -> dict:
    calls = [{"type": "object", "properties": {"tool_call": {
        "type": "object", "properties": {"name": {"const": t.function.name}, "arguments": parameters(t)},
        "required": ["name", "arguments"], "additionalProperties": False}},
        "required": ["tool_call"], "additionalProperties": False} for t in allowed(tools, choice)]
    if not forced:
        calls.append({"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                      "additionalProperties": False})
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def generic_grammar(tools: list, choice: str | None, *, parallel: bool, triggered: bool) -> dict:
    return {"kind": "json_schema", "spec": json.dumps(generic_schema(tools, choice, forced=not triggered)),
            "param": "tools" if triggered else "tool_choice"}


class _CallBlock(Block):
    pass


class GenericParser(ToolParser):
    """The reply is one JSON object; nothing is shown until its first key says which kind it is."""

    def __init__(self, tools=None, *, parallel: bool = True, forced: bool = False):
        super().__init__(tools, parallel=parallel, forced=forced)
        self.buf = ""
        self.kind: str | None = None
        self.start = 0
        self.json: JsonCall | None = None
        self.sent = ""  # response text sent so far
        self.done = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        if self.kind is None:
            m = HEAD.match(self.buf)
            if m is None:
                return self._take()
            self.kind, self.start = m.group(1), m.end()
            if self.kind == "tool_call":
                self.block = _CallBlock(self)
                self.json = JsonCall(self.block)
                self.json.feed(self.buf[self.start:])
                return self._take()
        elif self.kind == "tool_call":
            self.json.feed(text)
            return self._take()
        self._response(final=False)
        return self._take()

    def _response(self, final: bool) -> None:
        raw = self.buf[self.start:].lstrip()
        if not raw.startswith('"') or self.done:
            return
        i, esc = 1, False
        while i < len(raw):
            c = raw[i]
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                self.done = True
                break
            i += 1
        body = raw[1:i]
        for cut in range(len(body), max(len(body) - 7, -1), -1):  # an escape may be cut: hold it back
            try:
                text = json.loads('"' + body[:cut] + '"')
                break
            except ValueError:
                continue
        else:
            return
        if text.startswith(self.sent):
            new, self.sent = text[len(self.sent):], text
            self._content_out += new
            self.content += new

    def close(self) -> tuple[str, list[dict]]:
        if self.kind == "response":
            self._response(final=True)
        elif self.kind is None and not self.forced:
            self._content_out += self.buf
            self.content += self.buf
        if self.block is not None and self.block.call is not None:
            self.block.call.done = True
        self.block = None
        return self._take()

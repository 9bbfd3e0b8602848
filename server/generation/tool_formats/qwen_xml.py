"""Qwen3-Coder / Qwen3.5 XML tool calls:
`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`.
Values are raw text; each is typed by the tool's schema (a string stays text, anything else is read as
JSON when it parses). Arguments stream one parameter at a time, as JSON."""

import json
import re

from server.generation.tool_formats.base import Block, ToolParser
from server.generation.tool_formats.grammar import allowed, calls_grammar, json_args

START, END = "<tool_call>", "</tool_call>"
FUNCTION = re.compile(r"<function=([^>\n]+)>")
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
FUNCTION_END = "</function>"


def typed(value: str, schema: dict):
    """A parameter's text (blanks around it dropped) as the JSON value its schema asks for."""
    value = value.strip()
    kind = schema.get("type")
    if kind == "string" or (kind is None and all(isinstance(e, str) for e in schema.get("enum", [0]))):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


class XmlBlock(Block):
    def __init__(self, parser):
        super().__init__(parser)
        self.scanned = 0  # where the next parameter is looked for
        self.n_params = 0
        self.closed = False

    def feed(self, text: str) -> str | None:
        seen = len(self.text)
        self.text += text
        end = self.text.find(END, max(0, seen - len(END)))
        body = self.text if end < 0 else self.text[:end]
        self._scan(body)
        if end < 0:
            return None
        rest, self.text, self.end_text = self.text[end + len(END):], body, END
        self._finish()
        return rest

    def _scan(self, body: str) -> None:
        parser = self.parser
        if self.call is None:
            m = FUNCTION.search(body)
            if m is None:
                return
            self.call = parser.begin_call(m.group(1).strip())
            self.scanned = m.end()
        tool = parser.tools.get(self.call.name)
        props = ((tool.function.parameters or {}).get("properties") or {}) if tool is not None else {}
        while not self.closed:
            m = PARAMETER.search(body, self.scanned)
            f_end = body.find(FUNCTION_END, self.scanned)
            if m is None or (0 <= f_end < m.start()):
                if f_end >= 0:
                    self._finish()
                return
            key = m.group(1).strip()
            value = typed(m.group(2), props.get(key) or {})
            sep = "{" if self.n_params == 0 else ", "
            parser.add_arguments(self.call, sep + json.dumps(key, ensure_ascii=False) + ": "
                                 + json.dumps(value, ensure_ascii=False))
            self.n_params += 1
            self.scanned = m.end()

    def _finish(self) -> None:
        if self.call is None or self.closed:
            return
        self.closed = True
        self.parser.add_arguments(self.call, "}" if self.n_params else "{}")
        self.call.done = True

    def close(self) -> None:
        self._finish()


class QwenXmlParser(ToolParser):
    starts = ((START, False),)

    def open_block(self, marker: str) -> Block:
        return XmlBlock(self)


def qwen_xml_grammar(tools: list, choice: str | None, *, parallel: bool, triggered: bool) -> dict:
    tags = [{"type": "tag", "begin": f"{START}\n<function={t.function.name}>\n",
             "content": json_args(t, style="qwen_xml"), "end": f"\n{FUNCTION_END}\n{END}"}
            for t in allowed(tools, choice)]
    return calls_grammar(tags, choice=choice, parallel=parallel, triggered=triggered,
                         trigger=f"{START}\n<function=", separator="\n", param="tools" if triggered else "tool_choice")

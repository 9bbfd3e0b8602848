"""Llama 3.1/3.2/3.3 JSON tool calls: `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`."""

import json

from server.generation.tool_formats.base import Block, JsonCall, ToolParser
from server.generation.tool_formats.grammar import allowed, calls_grammar, json_args

TRIGGER = '{"name"'
PYTHON_TAG = "<|python_tag|>"


class JsonObjectBlock(Block):
    """A call that is one bare JSON object: the block ends where the object closes."""

    def __init__(self, parser):
        super().__init__(parser)
        self.json = JsonCall(self)

    def feed(self, text: str) -> str | None:
        at = self.json.feed(text)
        if at is None:
            self.text += text
            return None
        self.text += text[:at]
        if self.call is not None:
            self.call.done = True
        return text[at:]


class Llama3Parser(ToolParser):
    starts = ((TRIGGER, True),)
    strip = (PYTHON_TAG,)
    seps = " \t\r\n;"

    def open_block(self, marker: str) -> Block:
        return JsonObjectBlock(self)


def llama3_grammar(tools: list, choice: str | None, *, parallel: bool, triggered: bool) -> dict:
    tags = [{"type": "tag", "begin": f'{{"name": {json.dumps(t.function.name)}, "parameters": ',
             "content": json_args(t), "end": "}"} for t in allowed(tools, choice)]
    return calls_grammar(tags, choice=choice, parallel=parallel, triggered=triggered, trigger='{"name": ',
                         separator="; ", param="tools" if triggered else "tool_choice")

"""Hermes / Qwen2.5 / ChatML tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
one block per call (Qwen2.5, Qwen3, Hermes 2/3, SmolLM3 and most open models trained for tools)."""

import json

from server.generation.tool_formats.base import Block, JsonCall, ToolParser
from server.generation.tool_formats.grammar import allowed, calls_grammar, json_args

START, END = "<tool_call>", "</tool_call>"


class HermesBlock(Block):
    """The body between `<tool_call>` and `</tool_call>`: one JSON call object."""

    def __init__(self, parser):
        super().__init__(parser)
        self.json = JsonCall(self)

    def feed(self, text: str) -> str | None:
        seen = len(self.text)
        self.text += text
        end = self.text.find(END, max(0, seen - len(END)))
        body = self.text if end < 0 else self.text[:end]
        self.json.feed(body[len(self.json.buf):])
        if end < 0:
            return None
        rest, self.text, self.end_text = self.text[end + len(END):], body, END
        if self.call is not None:
            self.call.done = True
        return rest


class HermesParser(ToolParser):
    starts = ((START, False),)

    def open_block(self, marker: str) -> Block:
        return HermesBlock(self)


def hermes_grammar(tools: list, choice: str | None, *, parallel: bool, triggered: bool) -> dict:
    tags = [{"type": "tag", "begin": f'{START}\n{{"name": {json.dumps(t.function.name)}, "arguments": ',
             "content": json_args(t), "end": f"}}\n{END}"} for t in allowed(tools, choice)]
    return calls_grammar(tags, choice=choice, parallel=parallel, triggered=triggered, trigger=START,
                         separator="\n", param="tools" if triggered else "tool_choice")

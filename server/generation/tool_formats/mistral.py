"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Nemo,
Small). `[TOOL_CALLS]` is a control token that a decode skipping special tokens drops, so a bare
`[{"name"` opens a block too."""

import json

from server.generation.tool_formats.base import Block, Call, JsonCall, ToolParser
from server.generation.tool_formats.grammar import allowed, json_args, structural

MARKER = "[TOOL_CALLS]"


class ArrayBlock(Block):
    """`[obj, obj, ...]`: each object a call, the block ends at the closing `]`."""

    def __init__(self, parser):
        super().__init__(parser)
        self.json: JsonCall | None = None
        self.opened = False
        self.calls: list[Call] = []

    def feed(self, text: str) -> str | None:
        i = 0
        while i < len(text):
            if self.json is not None:
                at = self.json.feed(text[i:])
                if at is None:
                    self.text += text[i:]
                    return None
                self.text += text[i:i + at]
                i += at
                if self.call is not None:
                    self.call.done = True
                    self.calls.append(self.call)
                self.json, self.call = None, None
                continue
            c = text[i]
            self.text += c
            i += 1
            if c.isspace() or (c == "," and self.opened):
                continue
            if c == "[" and not self.opened:
                self.opened = True
            elif c == "{" and self.opened:
                self.json = JsonCall(self)
                self.json.feed("{")
            else:  # `]` ends the array; anything else ends a block that is not a call array
                self.call = self.calls[-1] if self.calls else None
                if c == "]":
                    return text[i:]
                self.text = self.text[:-1]
                return text[i - 1:]
        return None

    def close(self) -> None:
        if self.call is not None:
            self.call.done = True


class MistralParser(ToolParser):
    starts = ((MARKER, False), ('[{"name"', True))
    seps = " \t\r\n,"

    def open_block(self, marker: str) -> Block:
        return ArrayBlock(self)


def mistral_grammar(tools: list, choice: str | None, *, parallel: bool, triggered: bool) -> dict:
    tags = [{"type": "tag", "begin": f'{{"name": {json.dumps(t.function.name)}, "arguments": ',
             "content": json_args(t), "end": "}"} for t in allowed(tools, choice)]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": ", ", "at_least_one": True,
             "stop_after_first": not parallel or choice is not None}
    block = {"type": "tag", "begin": MARKER + "[", "content": calls, "end": "]"}
    if triggered:
        return structural({"type": "triggered_tags", "triggers": [MARKER], "tags": [block], "at_least_one": False,
                           "stop_after_first": True}, "tools")
    return structural(block, "tool_choice")

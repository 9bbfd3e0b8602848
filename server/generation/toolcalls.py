"""Tool calling for `/v1/responses` and `/v1/messages`, over the same machinery as chat completions
(`server.generation.tools` and its formats): the one place these APIs touch it, so a change there is adapted
here once.

`ToolPlan` takes the offered tools (as `server.generation.constraints.Tool`), the API's choice mode
(none | auto | required | named) and the model's chat template, whose tool-call format
(`server.generation.tools.format_for`: Hermes, Llama 3.x JSON, Mistral, Qwen3-Coder XML, or the generic JSON
format for a template that cannot render tools) decides everything else. It gives what a route needs:
- `prompting()`: how the tools reach the prompt (`Prompting.apply(messages)` -> the messages and the
  template's `tools=` argument; generic: the tools in a system message, earlier calls and results
  rewritten, no `tools=`), so `auto` works on every template;
- `guided(other)`: the decoding constraint (required/named: the output is calls; auto: whatever follows
  an opened call is a valid call; generic auto: a JSON call or answer);
- `parse(text)` (whole) and `stream()` (a `ToolStream`: content and calls as they are generated,
  arguments as fragments whose concatenation is the whole call's `arguments`).
"""

import json
from dataclasses import dataclass
from typing import Any

from server.errors import APIError
from server.generation.constraints import Tool
from server.generation.tools import (
    ToolFormat,
    ToolParser,
    call_grammar,
    format_for,
    generic_messages,
    template_tools,
    tool_parser,
)
from server.tokenization import TokenizerService

MODES = ("none", "auto", "required", "named")


def chat_template_of(tokens: TokenizerService):
    return getattr(tokens.tok, "chat_template", None)


@dataclass
class Prompting:
    """How offered tools reach the prompt: the template's `tools=` argument (`tools`: its dicts), or for
    a template that cannot render them (`generic`: `tools` are the `Tool`s) a system message describing
    them, with earlier calls as JSON replies and tool results as user turns."""

    tools: list
    generic: bool = False
    forced: bool = False

    def apply(self, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """(messages to render, the template's `tools=` argument)."""
        if self.generic:
            return generic_messages(messages, self.tools, self.forced), None
        return messages, self.tools


def prompt_args(prompting: Prompting | None, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
    """`Prompting.apply`, or the messages as they are when no tools are offered."""
    return (messages, None) if prompting is None else prompting.apply(messages)


class ToolPlan:
    def __init__(self, tools: list[Tool], mode: str, name: str | None = None, *, parallel: bool = True,
                 chat_template=None, param: str = "tools"):
        self.tools, self.mode, self.name, self.parallel, self.param = tools, mode, name, parallel, param
        self.fmt: ToolFormat = format_for(chat_template)
        if not tools:
            self.mode = "none"

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def prompting(self) -> Prompting | None:
        """How the tools are rendered (None: no tools in the prompt)."""
        if not self.active:
            return None
        if not self.fmt.renders_tools:
            return Prompting(list(self.tools), generic=True, forced=self.forced)
        return Prompting(template_tools(self.tools))

    def guided(self, other: dict | None = None) -> dict | None:
        """GuidedDecoding fields: the call grammar, or `other` (a response format) when no call is forced."""
        if self.forced:
            if other is not None:
                raise APIError(400, "a forced tool call and a structured output format both constrain the output; "
                               "send one of them", param=self.param)
            return call_grammar(self.tools, self.name, parallel=self.parallel, triggered=False, fmt=self.fmt)
        if self.mode == "auto" and not self.fmt.renders_tools and other is not None:
            raise APIError(400, "this model's chat template cannot render tools, so tool_choice 'auto' answers in "
                           "a constrained JSON (a call or a reply), which a structured output format would "
                           "contradict; send one of them", param=self.param)
        if self.mode == "auto" and other is None:
            return call_grammar(self.tools, None, parallel=self.parallel, triggered=True, fmt=self.fmt)
        return other

    def parser(self) -> ToolParser | None:
        if not self.active:
            return None
        return tool_parser(self.fmt, self.tools, parallel=self.parallel, forced=self.forced)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """The whole text -> (content, stripped when there are calls; the calls)."""
        parser = self.parser()
        if parser is None:
            return text, []
        content, calls = parser.parse(text)
        return content or "", calls

    def stream(self) -> "ToolStream":
        return ToolStream(self.parser())


class ToolStream:
    """A reply's text as it streams -> events in the order a client shows them:
    `("text", str)`; `("begin", header)` (a call's first OpenAI delta: index, id, type, function.name);
    `("arguments", index, fragment)`; `("end", call)` (the whole call, once its block closed, the next
    call began, or the output ended). The fragments of a call concatenate to its `arguments`. Without a
    parser (no tools offered) everything is text."""

    def __init__(self, parser: ToolParser | None):
        self.parser = parser
        self.open: list[int] = []  # indexes of calls begun and not ended
        self.called = False

    @property
    def calls(self) -> list[dict]:
        return self.parser.calls if self.parser is not None else []

    def feed(self, text: str, final: bool = False) -> list[tuple]:
        if self.parser is None:
            return [("text", text)] if text else []
        content, deltas = self.parser.feed(text)
        if final:
            more_content, more = self.parser.close()
            content, deltas = content + more_content, deltas + more
        before = set(self.open)
        events = [("arguments", d["index"], d["function"]["arguments"]) for d in deltas if d["index"] in before]
        events += self._ends(False)
        if content:
            events += self._ends(True) + [("text", content)]
        for d in deltas:
            if d["index"] in before:
                continue
            if "id" in d:
                events += self._ends(True)
                self.open.append(d["index"])
                self.called = True
                events.append(("begin", d))
            elif d["function"]["arguments"]:
                events.append(("arguments", d["index"], d["function"]["arguments"]))
        return events + self._ends(final)

    def _ends(self, all_open: bool) -> list[tuple]:
        kept = [c for c in self.parser.all_calls if not c.muted]
        events = []
        for index in list(self.open):
            if all_open or kept[index].done:
                self.open.remove(index)
                events.append(("end", kept[index].whole()))
        return events


def call_arguments(call: dict) -> str:
    """An OpenAI tool call's arguments (JSON text)."""
    return call["function"]["arguments"]


def template_call(call_id: str | None, name: str, arguments: Any) -> dict:
    """An assistant's earlier call as chat templates take it (arguments as an object when they parse)."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}

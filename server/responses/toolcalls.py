"""Tool calling for `/v1/responses` and `/v1/messages`, over the chat routes' own machinery
(`server.openai.tools`): the one place these APIs touch it, so a change there is adapted here once.

`ToolPlan` takes the offered tools (as `server.openai.constraints.Tool`) and the API's choice mode
(none | auto | required | named), and gives what a route needs: the `tools=` argument of the chat
template, the decoding constraint (required/named: the output is calls; auto: whatever follows an
opened `<tool_call>` is a valid call), and a parser that splits the generated text into content and
calls, whole or streamed (`ToolCallStream`).
"""

import json
from typing import Any

from server.errors import APIError
from server.openai.constraints import Tool
from server.openai.tools import ToolCallStream, call_grammar, supports_tools, template_tools
from server.tokenization import TokenizerService

MODES = ("none", "auto", "required", "named")


class ToolPlan:
    def __init__(self, tools: list[Tool], mode: str, name: str | None = None, *, parallel: bool = True,
                 param: str = "tools"):
        self.tools, self.mode, self.name, self.parallel, self.param = tools, mode, name, parallel, param
        if not tools:
            self.mode = "none"

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def template_tools(self, tokens: TokenizerService) -> list[dict] | None:
        """The tools to render in the prompt; a 400 for `auto` when the template cannot render them."""
        if not self.active:
            return None
        if supports_tools(getattr(tokens.tok, "chat_template", None)):
            return template_tools(self.tools)
        if self.mode == "auto":
            raise APIError(400, "this model's chat template cannot render tools, so the model cannot choose to "
                           "call one; force a call (a named tool, or required/any: decoding is then constrained "
                           "to a well-formed call), or send no tools", param=self.param)
        return None

    def guided(self, other: dict | None = None) -> dict | None:
        """GuidedDecoding fields: the call grammar, or `other` (a response format) when no call is forced."""
        if self.mode in ("required", "named"):
            if other is not None:
                raise APIError(400, "a forced tool call and a structured output format both constrain the output; "
                               "send one of them", param=self.param)
            return call_grammar(self.tools, self.name, parallel=self.parallel, triggered=False)
        if self.mode == "auto" and other is None:
            return call_grammar(self.tools, None, parallel=self.parallel, triggered=True)
        return other

    def stream(self) -> ToolCallStream | None:
        return ToolCallStream(self.parallel) if self.active else None


def split(stream: ToolCallStream | None, text: str, final: bool) -> tuple[str, list[dict]]:
    """Feed `text` (the last piece when `final`): (content to show now, calls completed now)."""
    if stream is None:
        return text, []
    content, calls = stream.feed(text)
    if final:
        content += stream.close()
    return content, calls


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

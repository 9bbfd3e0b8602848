"""Tool calling: tools into the prompt (through the model's chat template, or a system message for a
template that cannot render them), decoding constrained to well-formed calls, and the model's calls out
of its text, whole or streamed as OpenAI's argument deltas. The formats (Hermes, Llama 3.x JSON,
Mistral, Qwen3-Coder XML, generic JSON) live in `server.generation.tool_formats`, chosen from the template.

Guarantees:
- `tool_choice` "required" or a named function constrains decoding (an xgrammar structural tag, or a
  JSON schema for the generic format) so the output *is* one or more well-formed calls of the allowed
  functions with schema-valid arguments, whatever the model; "auto" constrains only what follows a
  call the model chose to open (generic: a JSON reply that is a call or an answer); "none" renders no
  tools and parses nothing.
- Parsing, whole or streamed, is one `ToolParser` (see `server.generation.tool_formats.base`): no markup in
  the content, the same calls whatever the split.
- Torch-free: grammars leave here as JSON text (`engine.api.sampling_params.GuidedDecoding` fields).

The functions below are the stable interface other API surfaces (responses, messages) call; their
defaults are the Hermes format, as before formats were chosen.
"""

from server.generation.tool_formats import FORMATS, GENERIC, HERMES, ToolFormat, format_for, renders_tools
from server.generation.tool_formats.base import ToolParser
from server.generation.tool_formats.generic import generic_messages
from server.generation.tool_formats.hermes import END, START

__all__ = ["END", "FORMATS", "GENERIC", "HERMES", "START", "ToolCallStream", "ToolFormat", "ToolParser",
           "call_grammar", "format_for", "generic_messages", "parse_tool_calls", "supports_tools",
           "template_tools", "tool_parser"]


def supports_tools(chat_template) -> bool:
    """Whether a chat template renders `tools` (HF templates that do reference the variable)."""
    return renders_tools(chat_template)


def template_tools(tools: list) -> list[dict]:
    """The `tools=` argument of `apply_chat_template`: OpenAI's `{"type": "function", "function": {...}}`."""
    return [{"type": "function", "function": t.function.as_dict()} for t in tools]


def call_grammar(tools: list, choice: str | None, *, parallel: bool, triggered: bool,
                 fmt: ToolFormat = HERMES) -> dict:
    """GuidedDecoding fields constraining the output to calls of `tools` (or only of `choice`, by name) in
    format `fmt`. triggered=False (required/named): the output is calls only, at least one.
    triggered=True (auto): free text, and whatever follows the opening of a call is a valid call."""
    return fmt.grammar(tools, choice, parallel=parallel, triggered=triggered)


def tool_parser(fmt: ToolFormat = HERMES, tools: list | None = None, *, parallel: bool = True,
                forced: bool = False) -> ToolParser:
    """A fresh parser of `fmt` for one choice: `feed(text)` -> (content delta, OpenAI tool-call deltas)."""
    return fmt.new_parser(tools, parallel=parallel, forced=forced)


class ToolCallStream:
    """Splits streamed text into content and *whole* tool calls: `feed(text)` -> (content delta, calls
    completed by this text); `close()` -> the content still held back. (For argument deltas as they are
    generated, use `tool_parser`.)"""

    def __init__(self, parallel: bool = True, fmt: ToolFormat = HERMES, tools: list | None = None):
        self.parser = fmt.new_parser(tools, parallel=parallel)
        self._reported = 0

    @property
    def calls(self) -> list[dict]:
        return [c.whole() for c in self._done()]

    @property
    def content(self) -> str:
        return self.parser.content

    def _done(self):
        return [c for c in self.parser.all_calls if not c.muted and c.done]

    def _new(self) -> list[dict]:
        done = self._done()
        new, self._reported = done[self._reported:], len(done)
        return [c.whole() for c in new]

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, _ = self.parser.feed(text)
        return content, self._new()

    def close(self) -> str:
        content, _ = self.parser.close()
        return content


def parse_tool_calls(text: str, parallel: bool = True, fmt: ToolFormat = HERMES,
                     tools: list | None = None) -> tuple[str | None, list[dict]]:
    """Whole text -> (content, or None when it is only calls and markup; calls)."""
    return fmt.new_parser(tools, parallel=parallel).parse(text)

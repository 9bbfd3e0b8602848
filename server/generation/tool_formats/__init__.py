"""Tool-call formats, chosen from the model's chat template: each is a parser (`base.ToolParser`: text ->
content + calls, whole or streamed) and a grammar (what `required`, a named choice and `auto`
constrain decoding to). `format_for(template)` picks one: Qwen3-Coder XML (`<function=`), Hermes
(`<tool_call>`), Mistral (`[TOOL_CALLS]`), Llama 3.x JSON (`<|python_tag|>` / `"parameters"`), Hermes for
any other template that renders tools, and the generic JSON format for a template that cannot."""

from collections.abc import Callable
from dataclasses import dataclass

from server.generation.tool_formats.base import ToolParser
from server.generation.tool_formats.generic import GenericParser, generic_grammar
from server.generation.tool_formats.hermes import HermesParser, hermes_grammar
from server.generation.tool_formats.llama3 import Llama3Parser, llama3_grammar
from server.generation.tool_formats.mistral import MistralParser, mistral_grammar
from server.generation.tool_formats.qwen_xml import QwenXmlParser, qwen_xml_grammar


@dataclass(frozen=True)
class ToolFormat:
    name: str
    parser: type[ToolParser]
    grammar: Callable[..., dict]  # (tools, choice, *, parallel, triggered) -> GuidedDecoding fields
    renders_tools: bool = True  # False: tools go in a system message (generic)

    def new_parser(self, tools: list | None = None, *, parallel: bool = True, forced: bool = False) -> ToolParser:
        return self.parser(tools, parallel=parallel, forced=forced)


HERMES = ToolFormat("hermes", HermesParser, hermes_grammar)
LLAMA3 = ToolFormat("llama3_json", Llama3Parser, llama3_grammar)
MISTRAL = ToolFormat("mistral", MistralParser, mistral_grammar)
QWEN_XML = ToolFormat("qwen3_coder", QwenXmlParser, qwen_xml_grammar)
GENERIC = ToolFormat("generic", GenericParser, generic_grammar, renders_tools=False)
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, QWEN_XML, GENERIC)}


def template_text(chat_template) -> str:
    if isinstance(chat_template, dict):
        return "\n".join(t for t in chat_template.values() if isinstance(t, str))
    return chat_template if isinstance(chat_template, str) else ""


def renders_tools(chat_template) -> bool:
    """Whether a chat template renders `tools` (HF templates that do reference the variable)."""
    return "tools" in template_text(chat_template)


def format_for(chat_template) -> ToolFormat:
    """The tool-call format a chat template speaks (see the module docstring for the order)."""
    text = template_text(chat_template)
    if "tools" not in text:
        return GENERIC
    if "<function=" in text and "<parameter=" in text:
        return QWEN_XML
    if "<tool_call>" in text:
        return HERMES
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    if "<|python_tag|>" in text or ('"parameters"' in text and "<|start_header_id|>" in text):
        return LLAMA3
    return HERMES

"""Request schemas of `POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic's Messages API),
and their messages as chat-template messages.

Guarantees (`server.schema`'s base: strict types, unknown fields ignored, explicit null = default; a
wrong type or range is a 400 naming the field, in Anthropic's error shape on these routes):
- `system` is a string or text blocks; `messages` alternate user/assistant turns whose content is a
  string or blocks: `text`, `tool_use` (assistant), `thinking`/`redacted_thinking` (assistant: an earlier
  reply's reasoning; a thinking block's text becomes the message's `reasoning_content`, which templates
  that keep reasoning render, a redacted one is dropped), `tool_result` (user, content a string or text
  blocks). `cache_control` is accepted anywhere and ignored (prefix sharing is automatic). Any other
  block (image, document, ...) is a 400 naming it.
- `thinking` (`enabled`, `adaptive`, `disabled`) reaches the template's thinking switch
  (`server.generation.reasoning.template_kwargs`); `budget_tokens` is accepted and not enforced (`max_tokens`
  bounds the whole reply); `display: "omitted"` sends thinking blocks without their text.
- `tool_use` blocks become an assistant message's `tool_calls`; `tool_result` blocks become `tool`
  messages (before the user's text of the same turn), as OpenAI-style chat templates take them.
"""

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from engine.api.sampling_params import MAX_TEMPERATURE
from server.generation.constraints import TOOL_NAME, Tool
from server.generation.toolcalls import template_call
from server.schema import ParamError, StrictModel


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str = ""
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                           and isinstance(b.get("text"), str) for b in value):
            return "".join(b["text"] for b in value)
        raise ValueError("a tool_result's content must be a string or a list of text blocks")


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # ours are empty: accepted and ignored


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str = ""


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


def _blocks(value: Any) -> Any:
    """A string is one text block."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return _blocks(value)

    @model_validator(mode="after")
    def _blocks_fit_the_role(self):
        for block in self.content:
            if isinstance(block, ToolUseBlock | ThinkingBlock | RedactedThinkingBlock) and self.role != "assistant":
                raise ParamError("messages", f"{block.type} blocks belong to assistant messages")
            if isinstance(block, ToolResultBlock) and self.role != "user":
                raise ParamError("messages", "tool_result blocks belong to user messages")
        return self


class AnthropicTool(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    def as_tool(self) -> Tool:
        fn = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            fn["description"] = self.description
        return Tool.model_validate({"type": "function", "function": fn})


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(StrictModel):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None

    @property
    def shown(self) -> bool:
        return self.display != "omitted"


class CountTokensRequest(StrictModel):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
                       for b in value):
                raise ValueError("system must be a string or a list of text blocks")
            return "\n\n".join(b["text"] for b in value)
        return value

    @model_validator(mode="after")
    def _tools_fit(self):
        names = [t.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ParamError("tools", "tool names must be unique")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not self.tools:
            raise ParamError("tool_choice", f"tool_choice {choice.type!r} needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ParamError("tool_choice", f"tool_choice names {choice.name!r}, which is not one of the tools "
                             f"({', '.join(names)})")
        return self

    def tool_mode(self) -> tuple[str, str | None, bool]:
        """(none | auto | required | named, the named tool, parallel calls allowed)."""
        choice = self.tool_choice
        parallel = not (choice is not None and choice.disable_parallel_tool_use)
        if not self.tools or (choice is not None and choice.type == "none"):
            return "none", None, parallel
        if choice is None or choice.type == "auto":
            return "auto", None, parallel
        if choice.type == "any":
            return "required", None, parallel
        return "named", choice.name, parallel

    def chat_messages(self) -> list[dict]:
        """The conversation as chat-template messages (system first)."""
        out = [{"role": "system", "content": self.system}] if self.system is not None else []
        for m in self.messages:
            if m.role == "assistant":
                text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                thought = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
                if thought:
                    msg["reasoning_content"] = thought
                calls = [template_call(b.id, b.name, b.input) for b in m.content if isinstance(b, ToolUseBlock)]
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
                continue
            for b in m.content:
                if isinstance(b, ToolResultBlock):
                    content = b.content if not b.is_error else f"Error: {b.content}"
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
            texts = [b.text for b in m.content if isinstance(b, TextBlock)]
            if texts or not any(isinstance(b, ToolResultBlock) for b in m.content):
                out.append({"role": "user", "content": "".join(texts)})
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        return [s for s in value if s] if value is not None else None

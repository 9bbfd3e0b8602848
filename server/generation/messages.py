"""What a client sends as a prompt, shared by every route that takes one: chat messages (`ChatMessage`, with
earlier tool calls), token-id lists, and exactly one prompt or messages (`PromptOrMessages`).

Guarantees: message `content` is normalised to text by a hand-written validator (only text parts are
served; anything else is a 400), so routes never re-check it; a message renders as chat templates take
it (`as_template_dict`), earlier call arguments as objects.
"""

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from server.schema import ParamError, StrictModel


class FunctionCall(StrictModel):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCall(StrictModel):
    """An assistant's earlier call, sent back in a follow-up turn (OpenAI's shape)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


def template_arguments(args: str | dict) -> dict | str:
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return args
        return parsed if isinstance(parsed, dict) else args
    return args


ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)



class ChatMessage(StrictModel):
    """One chat turn. `content` may be a string or OpenAI content parts; only text parts are served.
    An assistant turn may carry `tool_calls`, a `tool` turn answers one (`tool_call_id`)."""

    role: Literal[ROLES]
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ParamError("messages", f"only assistant messages carry tool_calls (this one is {self.role!r})")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _content_text(cls, value: Any) -> str | None:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = []
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
                texts.append(part["text"])
            return "".join(texts)
        raise ValueError("content must be a string or a list of text content parts")

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it; call arguments as objects (templates `tojson` them)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": template_arguments(c.function.arguments)}} for c in self.tool_calls]
        return out


def normalize_single_prompt(value: Any) -> str | list[int] | None:
    """str | list[int] | None: one prompt (sequences and tokenize take exactly one)."""
    if value is None or isinstance(value, str):
        return value
    if is_token_list(value) and value:
        return list(value)
    raise ValueError("prompt must be a string or a non-empty list of non-negative token ids")


class PromptOrMessages(StrictModel):
    """Exactly one prompt (text or token ids) or chat messages: a sequence's input, and /tokenize's."""

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int] | None:
        return normalize_single_prompt(value)

    def _require_exactly_one(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "give exactly one of prompt or messages")

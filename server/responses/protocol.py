"""Request schema of `POST /v1/responses` (OpenAI's Responses API) and its input items as chat-template
messages.

Guarantees (those of every request schema here, `server.schema`): strict types, unknown fields
ignored, explicit null = the default, a wrong type or range is a 400 naming the field. A Responses
field this server does not honour is a 400 naming it (`REFUSED`) unless it holds its no-op value;
`metadata`, `user`, `service_tier`, `prompt_cache_key`, `safety_identifier` are accepted and ignored
(metadata is echoed back). Input is text or items: messages (`input_text`/`output_text` parts; roles
user, system, developer (rendered as system), assistant), `function_call` and `function_call_output`
items, and `reasoning` items (an earlier reply's thinking: its text becomes the next assistant message's
`reasoning_content`, which templates that keep reasoning render); anything else (images, files, item
references) is a 400 naming the item. `reasoning.effort` reaches the template's thinking switch as chat's
`reasoning_effort` does (`server.generation.reasoning.template_kwargs`); `reasoning.summary` is accepted and
echoed (the reply's reasoning comes as `reasoning_text` content, never summarised); `include:
["reasoning.encrypted_content"]` (what stateless agents send) is accepted: nothing is encrypted, the
reasoning is in the item's content and `encrypted_content` stays null.
"""

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from engine.api.sampling_params import MAX_TEMPERATURE
from server.generation.constraints import TOOL_NAME, Tool
from server.generation.telemetry import TelemetryFields
from server.generation.toolcalls import template_call
from server.schema import ParamError, StrictModel

# field -> the values that mean "off" (accepted); anything else is a 400 naming the field.
REFUSED: dict[str, tuple] = {
    "background": (False,), "conversation": (), "prompt": (), "top_logprobs": (0,),
    "truncation": ("disabled",), "include": ([], ["reasoning.encrypted_content"]), "max_tool_calls": (), "stream_options": (),
    "verbose": (False,),  # llama.cpp's __verbose is served on chat and completions only
}
TEXT_PART_TYPES = ("input_text", "output_text", "text")


def _text_of(value: Any, what: str) -> str:
    """A string, or text content parts joined; anything else (images, files, audio) is refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES \
                    or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text parts ({', '.join(TEXT_PART_TYPES)}) are supported in {what}, "
                                 f"got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{what} must be a string or a list of input_text parts")


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str:
        return _text_of(value, "message content")


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    output: str

    @field_validator("output", mode="before")
    @classmethod
    def _output(cls, value: Any) -> str:
        return _text_of(value, "a function_call_output's output")


class ReasoningPart(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None  # ours are never encrypted: accepted and ignored

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class ReasoningConfig(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name of `summary`


class FunctionTool(StrictModel):
    """A Responses function tool (flat: `{"type": "function", "name", "parameters", ...}`)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_tool(self) -> Tool:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters,
              "strict": self.strict}
        return Tool.model_validate({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_present(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ParamError("text.format", "type json_schema needs a schema: {'type': 'json_schema', 'name': ..., "
                             "'schema': {...}}")
        return self


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ResponsesRequest(TelemetryFields):
    refused: ClassVar[dict[str, tuple]] = REFUSED

    @model_validator(mode="before")
    @classmethod
    def _refused_and_input(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, off in cls.refused.items():
                value = data.get(name)
                if value is not None and not any(value == v and type(value) is type(v) for v in off):
                    raise ParamError(name, f"'{name}' is not supported by this server (got {value!r}); remove it"
                                     + (f" or send {off[0]!r}" if off else ""))
            data = {**data, "input": _items(data.get("input"))}
        return data

    model: str | None = None
    input: list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extra
    seed: int | None = None  # vLLM's extra
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _tools_fit(self):
        names = [t.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ParamError("tools", "tool names must be unique")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ParamError("tool_choice", "tool_choice needs tools; send tools or leave tool_choice unset")
        if isinstance(self.tool_choice, NamedFunctionChoice) and self.tool_choice.name not in names:
            raise ParamError("tool_choice", f"tool_choice names {self.tool_choice.name!r}, which is not one of the "
                             f"tools ({', '.join(names)})")
        return self

    def tool_mode(self) -> tuple[str, str | None]:
        """(none | auto | required | named, the named function)."""
        if not self.tools or self.tool_choice == "none":
            return "none", None
        if isinstance(self.tool_choice, NamedFunctionChoice):
            return "named", self.tool_choice.name
        return self.tool_choice or "auto", None

    def guided(self) -> dict | None:
        """`text.format` as GuidedDecoding fields (json_object / json_schema), None for plain text."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"kind": "json_object", "param": "text.format"}
        return {"kind": "json_schema", "spec": json.dumps(fmt.schema_), "param": "text.format"}

    def messages(self) -> list[dict]:
        """The input items as chat-template messages (instructions are not among them)."""
        return items_as_messages(self.input)


def _items(value: Any) -> Any:
    """Text -> one user message; message items may leave out their `type` (as the SDK's easy form)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return [{**v, "type": "message"} if isinstance(v, dict) and "type" not in v and "role" in v else v
                for v in value]
    return value


def items_as_messages(items: list) -> list[dict]:
    """Messages as chat templates take them: developer -> system; function_call items join the assistant
    turn they follow (or make one); function_call_output items become `tool` messages; a reasoning item's
    text becomes the `reasoning_content` of the assistant message that follows it."""
    out: list[dict] = []
    thought: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            thought = (thought or "") + item.text()
            continue
        if isinstance(item, MessageItem):
            msg = {"role": "system" if item.role == "developer" else item.role, "content": item.content}
        elif isinstance(item, FunctionCallItem):
            call = template_call(item.call_id, item.name, item.arguments)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and thought is None:
                last.setdefault("tool_calls", []).append(call)
                continue
            msg = {"role": "assistant", "content": "", "tool_calls": [call]}
        else:
            msg = {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
        if thought is not None and msg["role"] == "assistant":
            msg["reasoning_content"], thought = thought, None
        out.append(msg)
    return out

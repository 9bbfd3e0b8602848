"""Request schemas for structured output and tool calling, and the tables of fields this server refuses
or ignores (see `server.protocol`, whose request models use them)."""

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from server.protocol_base import ParamError, StrictModel

# field -> the values that mean "off" (accepted and ignored); any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (1,), "use_beam_search": (False,), "length_penalty": (1, 1.0), "early_stopping": (False,),
    "min_tokens": (0,), "allowed_token_ids": (), "bad_words": ([],), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (),
    "guided_whitespace_pattern": (), "structural_tag": (), "logits_processors": ([],), "typical_p": (1, 1.0),
    "top_a": (0, 0.0), "tfs_z": (1, 1.0), "mirostat": (0,), "n_probs": (0,), "grammar": ("",), "json_schema": (),
    "return_tokens_as_token_ids": (False,), "prompt_logprobs": (), "priority": (0,), "kv_transfer_params": (),
    "vllm_xargs": (), "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (),
    "web_search_options": (), "functions": (), "function_call": ("none",), "documents": (), "chat_template": (),
    "chat_template_kwargs": (), "continue_final_message": (False,), "mm_processor_kwargs": (),
    "verbosity": (), "bad_words_ids": (), "min_length": (0,), "thinking": (),
}
# Fields of one route that another route does not honour (e.g. `tools` sent to /v1/completions).
CHAT_ONLY: dict[str, tuple] = {"tools": ([],), "tool_choice": ("none",), "max_completion_tokens": (),
                               "top_logprobs": ()}
COMPLETIONS_ONLY: dict[str, tuple] = {"echo": (False,), "suffix": ("",)}
# Accepted and ignored: they change nothing this server computes (listed in the README).
IGNORED = ("model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
           "request_id", "parallel_tool_calls (without tools)")
GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
GUIDED_BACKENDS = ("xgrammar", "auto")


def reject_unsupported(data: dict, unsupported: dict[str, tuple]) -> None:
    for name, off in unsupported.items():
        value = data.get(name)
        if value is None or any(value == v and type(value) is type(v) for v in off):
            continue
        raise ParamError(name, f"'{name}' is not supported by this server (got {value!r}); remove it"
                         + (f" or send {off[0]!r}" if off else ""))


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


class FunctionDef(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_dict(self) -> dict:
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        out["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return out


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(StrictModel):
    """`response_format.json_schema`: the output must be JSON valid against `schema` (always enforced by
    the grammar, so `strict` true or false both get schema-valid JSON)."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=256)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ParamError("response_format", "type json_schema needs a json_schema object: "
                             "{'name': ..., 'schema': {...}, 'strict': true}")
        return self

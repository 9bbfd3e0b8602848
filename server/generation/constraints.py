"""Request schemas of what may constrain a chat answer: the tools offered (`Tool`), `tool_choice`
(`NamedToolChoice`) and `response_format` (`ResponseFormat`)."""

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from server.schema import ParamError, StrictModel

TOOL_NAME = r"^[A-Za-z0-9_.\-]+$"  # what a function name may hold, on every API that offers tools


class FunctionDef(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=TOOL_NAME)
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
    """`schema` with type json_object is llama.cpp's extension: the object must also be valid against it
    (applied as json_schema is, never ignored)."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _schema_present(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ParamError("response_format", "type json_schema needs a json_schema object: "
                             "{'name': ..., 'schema': {...}, 'strict': true}")
        if self.schema_ is not None and self.type != "json_object":
            raise ParamError("response_format", f"a top-level 'schema' goes with type json_object (llama.cpp's "
                             f"form), not {self.type!r}; for json_schema put it in json_schema.schema")
        return self

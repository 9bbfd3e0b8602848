"""Request schemas of `/tokenize` and `/detokenize` (vLLM's shapes)."""

from pydantic import field_validator, model_validator

from server.schema import ParamError, StrictModel
from server.sequences.protocol import PromptOrMessages


class TokenizeRequest(PromptOrMessages):
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _exactly_one(self):
        self._require_exactly_one()
        if isinstance(self.prompt, list):
            raise ParamError("prompt", "prompt must be a string (it is what gets tokenized)")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("token ids must be non-negative")
        return value

"""Request schemas of `/tokenize` and `/detokenize` (vLLM's shapes, and llama.cpp's: `content`, `add_special`,
`with_pieces`)."""

from pydantic import field_validator, model_validator

from server.generation.messages import PromptOrMessages
from server.schema import ParamError, StrictModel


class TokenizeRequest(PromptOrMessages):
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    content: str | None = None  # llama.cpp's name for the text; then `add_special` and `with_pieces` apply
    add_special: bool = False
    with_pieces: bool = False

    @model_validator(mode="before")
    @classmethod
    def _llamacpp(cls, data):
        if isinstance(data, dict) and data.get("content") is not None:
            if data.get("prompt") is not None or data.get("messages") is not None:
                raise ParamError("content", "give content (llama.cpp) or prompt/messages (vLLM), not both")
            data = {**data, "prompt": data["content"], "add_special_tokens": bool(data.get("add_special", False))}
        return data

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

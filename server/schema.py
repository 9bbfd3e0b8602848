"""The base of every request schema: strict types, explicit null = default, text that is valid Unicode,
and `ParamError` for cross-field problems that still name their param (see `server.errors`)."""

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class StrictModel(BaseModel):
    """Strict types, unknown fields ignored, and an explicit `null` means "use the default" (as OpenAI)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_text(data, "")
            return {k: v for k, v in data.items() if v is not None}
        return data


class ParamError(ValueError):
    """A cross-field problem that still names its param (kept by pydantic in the error's ctx)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check_text(value: Any, path: str) -> None:
    """Every string in the body must be encodable Unicode: JSON allows escapes of lone surrogates
    (`"\\ud800"`), which no tokenizer can take. Raises naming the field instead of failing later."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ParamError(path or "body", f"contains an unpaired surrogate (U+{ord(value[exc.start]):04X}) at "
                             f"character {exc.start}, which is not valid Unicode text; send UTF-8 text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path or "body")
            _check_text(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{path}[{i}]")

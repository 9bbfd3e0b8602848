"""Request schemas of llama.cpp's native routes (`/completion`, `/infill`, `/apply-template`, slot actions), in
llama.cpp's field names, and their mapping onto the engine's `SamplingParams`.

Guarantees: fields are checked as the OpenAI routes check theirs (strict types, a 400 naming the field); a
llama.cpp sampling field cellserve does not honour is refused by name (`REFUSED`) unless it holds its off
value, never silently ignored; fields that change nothing here (`cache_prompt`: the prefix cache and the
slots reuse cells anyway; `samplers` order; `t_max_*`) are accepted.
"""

import re
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from server.generation.lora import LoraEntry, lora_ref
from server.generation.telemetry import TelemetryFields
from server.schema import ParamError, StrictModel

# llama.cpp's default n_predict is -1 (until the context is full or EOS)
# field -> values that mean "off" (accepted); any other value is a 400 naming it
REFUSED: dict[str, tuple] = {"mirostat": (0,), "typical_p": (1, 1.0), "dry_multiplier": (0, 0.0),
                             "xtc_probability": (0, 0.0), "dynatemp_range": (0, 0.0), "top_n_sigma": (-1, -1.0),
                             "image_data": ([],), "multimodal_data": ([],),
                             "post_sampling_probs": (False,), "n_indent": (0,), "n_cmpl": (1,)}
FILENAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class NativeSampling(TelemetryFields):
    """The sampling fields of llama.cpp's `/completion` and `/infill`."""

    refused: ClassVar[dict[str, tuple]] = REFUSED
    n_predict: int = Field(-1, ge=-1)
    max_tokens: int | None = Field(None, ge=0)  # the OpenAI name, also taken by llama.cpp
    temperature: float = Field(0.8, ge=0.0)
    top_k: int = Field(40, ge=-1)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    seed: int = -1
    stop: list[str] = Field(default_factory=list, max_length=16)
    n_probs: int = Field(0, ge=0, le=20)
    repeat_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    logit_bias: list[list[Any]] | dict[str, Any] | None = None
    lora: list[LoraEntry] | None = Field(None, max_length=16)  # [{id, scale}]: the request's adapter (server/adapters)
    stream: bool = False
    cache_prompt: bool = True
    id_slot: int = Field(-1, ge=-1)
    return_tokens: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, off in cls.refused.items():
                value = data.get(name)
                if value is not None and not any(value == v and type(value) is type(v) for v in off):
                    raise ParamError(name, f"'{name}' is not supported by this server (got {value!r}); remove it")
        return data

    @model_validator(mode="after")
    def _bias_checked(self):
        self.bias_ids()
        return self

    def engine_fields(self, eog_ids: list[int]) -> dict[str, Any]:
        """SamplingParams keyword arguments (llama.cpp names -> the engine's). `eog_ids`: the model's
        end-of-generation tokens, banned under `ignore_eos` as llama.cpp bans them (a -inf bias: the reply
        runs to `n_predict`, never through an end token)."""
        out: dict[str, Any] = {"temperature": self.temperature, "top_k": max(self.top_k, 0), "top_p": self.top_p,
                               "min_p": self.min_p, "repetition_penalty": self.repeat_penalty,
                               "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                               "ignore_eos": self.ignore_eos, "logprobs": self.n_probs or None,
                               "lora": lora_ref(None, self.lora)}
        if self.seed >= 0:
            out["seed"] = self.seed
        if self.stop:
            out["stop"] = list(self.stop)
        bias = {t: b for t, b in self.bias_pairs(eog_ids).items() if b is not None}
        if bias:
            out["logit_bias"] = bias
        banned = [[t] for t, b in self.bias_pairs(eog_ids).items() if b is None]
        if banned:
            out["bad_words_ids"] = banned
        return out

    def settings_bias(self, eog_ids: list[int]) -> list[dict[str, Any]]:
        """`generation_settings.logit_bias` as llama-server reports it: `[{"bias", "token"}]`, `null` for a
        banned token (-inf), the end-of-generation tokens among them under `ignore_eos`."""
        return [{"bias": b, "token": t} for t, b in self.bias_pairs(eog_ids).items()]

    def bias_pairs(self, eog_ids: list[int]) -> dict[int, float | None]:
        """Token id -> bias (None: banned): the request's `logit_bias`, then `eog_ids` under `ignore_eos`."""
        out = self.bias_ids()
        if self.ignore_eos:
            out.update({t: None for t in eog_ids})
        return out

    def bias_ids(self) -> dict[int, float | None]:
        """llama.cpp's `logit_bias`: `[[id, bias], ...]` or `{"id": bias}`; `false` bans the token (None)."""
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or [])
        out: dict[int, float | None] = {}
        for pair in pairs:
            key, value = tuple(pair) if not isinstance(pair, tuple) else pair
            if isinstance(key, str) and key.isdigit():
                key = int(key)
            if not isinstance(key, int) or isinstance(key, bool):
                raise ParamError("logit_bias", f"keys must be token ids here (got {key!r}); tokenize text first")
            if value is False:
                out[key] = None
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ParamError("logit_bias", f"a bias is a number or false, got {value!r}")
            out[key] = float(value)
        return out


class NativeCompletionRequest(NativeSampling):
    """`POST /completion`: `prompt` as text, token ids, or a list mixing them (llama.cpp's forms; one prompt)."""

    prompt: str | list[int | str] = ""

    @field_validator("prompt", mode="before")
    @classmethod
    def _json_prompt(cls, value):
        """llama.cpp's JSON prompt `{"prompt_string": TEXT, "multimodal_data": [...]}`: its text (no media here)."""
        if not isinstance(value, dict):
            return value
        if value.get("multimodal_data"):
            raise ValueError("this server takes no images or audio (multimodal_data); send text only")
        text = value.get("prompt_string")
        if not isinstance(text, str) or set(value) - {"prompt_string", "multimodal_data"}:
            raise ValueError('a JSON prompt is {"prompt_string": TEXT}')
        return text

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("give a prompt: text, or token ids")
        return value


class InfillRequest(NativeSampling):
    """`POST /infill`: the text before and after the cursor, optional extra context chunks, and an optional
    `prompt` (text already typed at the cursor, generation continues it)."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[dict[str, str]] = Field(default_factory=list, max_length=64)
    prompt: str = ""


class ApplyTemplateRequest(StrictModel):
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True


class SlotFile(StrictModel):
    """Slot save/restore: `filename`, a plain name (no path) under the state dir."""

    filename: str

    @field_validator("filename")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not FILENAME.match(value) or ".." in value:
            raise ValueError("a plain file name (letters, digits, '.', '_', '-'; no path), e.g. slot0.bin")
        return value

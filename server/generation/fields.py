"""The sampling fields every generating route shares (OpenAI + vLLM + llama.cpp names), as one pydantic
model (`SamplingFields`), and the tables of fields this server refuses or ignores: what a client may
send, checked before any work.

Guarantees:
- Unknown fields are ignored, as OpenAI's server does (the `openai` SDK's `extra_body` lands here), but a
  known OpenAI/vLLM/llama.cpp field this server does not honour is a 400 naming it (`UNSUPPORTED`),
  unless it holds its no-op value (`best_of: 1`, `use_beam_search: false`, ...): a request is never
  silently answered as if a field it relies on had been applied. Fields that change nothing here
  (`user`, `model`, `metadata`, `store`, `service_tier`, ...) are accepted and ignored (`IGNORED`).
- Types are strict: `"5"` is not an int, `1` is not a bool; a float field accepts an int. A wrong type
  or an out-of-range value is a 400 whose `param` names the field (see `server.errors`).
- `stop` is normalised to one shape by a hand-written validator, so routes never re-check it.
The base model lives in `server.schema`, the tool and response_format schemas in
`server.generation.constraints`; turning these fields into the engine's `SamplingParams` is
`server.generation.sampling`.
"""

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from engine.api.sampling_params import MAX_N, MAX_TEMPERATURE, PENALTY_RANGE, check_logit_bias
from server.generation.constraints import ResponseFormat
from server.generation.lora import LoraEntry
from server.schema import ParamError, StrictModel

# --- The tables of fields this server refuses or ignores (the request models below use them).

# field -> the values that mean "off" (accepted and ignored); any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (1,), "use_beam_search": (False,), "length_penalty": (1, 1.0), "early_stopping": (False,),
    "guided_whitespace_pattern": (), "structural_tag": (), "logits_processors": ([],), "typical_p": (1, 1.0),
    "top_a": (0, 0.0), "tfs_z": (1, 1.0), "mirostat": (0,), "n_probs": (0,),
    "return_tokens_as_token_ids": (False,), "prompt_logprobs": (), "kv_transfer_params": (),
    "vllm_xargs": (), "audio": (), "modalities": (["text"],),
    "web_search_options": (), "functions": (), "function_call": ("none",), "documents": (), "chat_template": (),
    "continue_final_message": (False,), "mm_processor_kwargs": (),
    "verbosity": (), "bad_words_ids": (), "min_length": (0,),
}
# Fields of one route that another route does not honour (e.g. `tools` sent to /v1/completions).
CHAT_ONLY: dict[str, tuple] = {"tools": ([],), "tool_choice": ("none",), "max_completion_tokens": (),
                               "top_logprobs": (), "chat_template_kwargs": (), "reasoning_effort": (),
                               "thinking": ()}
COMPLETIONS_ONLY: dict[str, tuple] = {"echo": (False,), "suffix": ("",)}
# Accepted and ignored: they change nothing this server computes (listed in docs/api.md).
IGNORED = ("model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
           "request_id", "parallel_tool_calls (without tools)", "spaces_between_special_tokens (fast tokenizers never add them)")
GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar",
                 "json_schema")
GUIDED_BACKENDS = ("xgrammar", "auto")


def reject_unsupported(data: dict, unsupported: dict[str, tuple]) -> None:
    for name, off in unsupported.items():
        value = data.get(name)
        if value is None or any(value == v and type(value) is type(v) for v in off):
            continue
        raise ParamError(name, f"'{name}' is not supported by this server (got {value!r}); remove it"
                         + (f" or send {off[0]!r}" if off else ""))



class PredictionPart(StrictModel):
    type: Literal["text"]
    text: str


class Prediction(StrictModel):
    """OpenAI's predicted output: `{"type": "content", "content": text or [text parts]}`."""

    type: Literal["content"]
    content: str | list[PredictionPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)



class StreamOptions(StrictModel):
    include_usage: bool = False



class SamplingFields(StrictModel):
    """Sampling fields shared by completions, chat and sequence completions (OpenAI + vLLM extras)."""

    unsupported: ClassVar[dict[str, tuple]] = UNSUPPORTED

    @model_validator(mode="before")
    @classmethod
    def _unsupported_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            reject_unsupported(data, cls.unsupported)
        return data

    model: str | None = None  # a loaded LoRA adapter's name runs the request under it (server/generation/lora.py)
    lora: list[LoraEntry] | None = Field(None, max_length=16)  # llama.cpp's [{id, scale}]
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    grammar: str | None = None  # llama.cpp's name for guided_grammar (GBNF/EBNF)
    json_schema: dict[str, Any] | None = None  # llama.cpp's name for guided_json
    # vLLM's extras (engine.api.sampling_params.SamplingParams documents each rule)
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    bad_words: list[str] | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    skip_special_tokens: bool = True
    # Fast tokenizers (every model here) never put spaces between special tokens: accepted either way, as vLLM
    spaces_between_special_tokens: bool = True
    # OpenAI's predicted outputs: a draft source when the engine speculates (never changes the output)
    prediction: Prediction | None = None

    @field_validator("grammar", mode="before")
    @classmethod
    def _empty_grammar_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> list[str] | None:
        if value is None:
            return None
        if isinstance(value, str):
            return [value] if value else []
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return [s for s in value if s]
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        check_logit_bias(value)  # the engine's rule: keys are token ids, values in its range
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream=true")
        return self

    @model_validator(mode="after")
    def _one_guide(self):
        given = [f for f in GUIDED_FIELDS if getattr(self, f) is not None
                 and not (f == "response_format" and self.response_format.type == "text")]
        if len(given) > 1:
            raise ParamError(given[1], f"give at most one of {', '.join(given)}: they each constrain the output")
        if self.guided_decoding_backend is not None and self.guided_decoding_backend not in GUIDED_BACKENDS:
            raise ParamError("guided_decoding_backend", f"this server decodes with xgrammar; send one of "
                             f"{GUIDED_BACKENDS} or leave it unset (got {self.guided_decoding_backend!r})")
        if isinstance(self.guided_json, str):
            try:
                self.guided_json = json.loads(self.guided_json)
            except ValueError as exc:
                raise ParamError("guided_json", f"is not valid JSON: {exc}") from None
            if not isinstance(self.guided_json, dict):
                raise ParamError("guided_json", "must be a JSON schema object")
        if self.guided_choice is not None and (not self.guided_choice or not all(self.guided_choice)):
            raise ParamError("guided_choice", "give a non-empty list of non-empty strings")
        return self

    def guided(self) -> dict | None:
        """The output constraint as `engine.api.sampling_params.GuidedDecoding` fields (kind, spec, choices, param)."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object" and rf.schema_ is not None:  # llama.cpp's extension
            return {"kind": "json_schema", "spec": json.dumps(rf.schema_), "param": "response_format"}
        if rf is not None and rf.type == "json_object":
            return {"kind": "json_object", "param": "response_format"}
        if rf is not None and rf.type == "json_schema":
            return {"kind": "json_schema", "spec": json.dumps(rf.json_schema.schema_), "param": "response_format"}
        if self.guided_json is not None:
            return {"kind": "json_schema", "spec": json.dumps(self.guided_json), "param": "guided_json"}
        if self.guided_regex is not None:
            return {"kind": "regex", "spec": self.guided_regex, "param": "guided_regex"}
        if self.guided_choice is not None:
            return {"kind": "choice", "choices": tuple(self.guided_choice), "param": "guided_choice"}
        if self.guided_grammar is not None:
            return {"kind": "grammar", "spec": self.guided_grammar, "param": "guided_grammar"}
        if self.grammar is not None:
            return {"kind": "grammar", "spec": self.grammar, "param": "grammar"}
        if self.json_schema is not None:
            return {"kind": "json_schema", "spec": json.dumps(self.json_schema), "param": "json_schema"}
        return None

    def logit_bias_ids(self) -> dict[int, float] | None:
        return check_logit_bias(self.logit_bias) or None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


"""Request schemas (pydantic v2) of the OpenAI routes, and the sampling fields every generating route
shares: what a client may send, checked before any work.

Guarantees:
- Unknown fields are ignored, as OpenAI's server does (the `openai` SDK's `extra_body` lands here), but a
  known OpenAI/vLLM/llama.cpp field this server does not honour is a 400 naming it (`UNSUPPORTED`),
  unless it holds its no-op value (`best_of: 1`, `use_beam_search: false`, ...): a request is never
  silently answered as if a field it relies on had been applied. Fields that change nothing here
  (`user`, `model`, `metadata`, `store`, `service_tier`, ...) are accepted and ignored (`IGNORED`).
- Types are strict: `"5"` is not an int, `1` is not a bool; a float field accepts an int. A wrong type
  or an out-of-range value is a 400 whose `param` names the field (see `server.errors`).
- Polymorphic fields (`prompt`, `stop`, message `content`) are checked by hand-written validators
  and normalised to one shape, so routes never re-check them and error locations stay plain field
  paths (no pydantic union tags).
Responses are plain dicts built in `server.openai.completions` and `server.openai.chat`, in OpenAI's
exact shapes. The base model lives in `server.schema`, the tool and response_format schemas in
`server.openai.constraints`; the refused/ignored field tables are here.
"""

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from engine.api.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_TEMPERATURE,
    PENALTY_RANGE,
    GuidedDecoding,
    SamplingParams,
    check_logit_bias,
)
from server.errors import APIError
from server.openai.constraints import NamedToolChoice, ResponseFormat, Tool
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


def normalize_prompts(value: Any) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> a non-empty list of prompts."""
    hint = "give a string, a list of strings, a list of token ids, or a list of token-id lists"
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise ValueError(f"prompt must not be empty; {hint}")
    if all(isinstance(p, str) for p in value):
        return list(value)
    if is_token_list(value):
        return [list(value)]
    if all(is_token_list(p) and p for p in value):
        return [list(p) for p in value]
    raise ValueError(f"prompt has a wrong shape or a negative/non-integer token id; {hint}")


class StreamOptions(StrictModel):
    include_usage: bool = False


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


class SamplingFields(StrictModel):
    """Sampling fields shared by completions, chat and sequence completions (OpenAI + vLLM extras)."""

    unsupported: ClassVar[dict[str, tuple]] = UNSUPPORTED

    @model_validator(mode="before")
    @classmethod
    def _unsupported_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            reject_unsupported(data, cls.unsupported)
        return data

    model: str | None = None
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


class CompletionRequest(SamplingFields):
    unsupported: ClassVar[dict[str, tuple]] = {
        **{k: v for k, v in UNSUPPORTED.items() if k != "prompt_logprobs"}, **CHAT_ONLY}

    prompt: list[str | list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: score the prompt, generate nothing
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: per-choice `prompt_logprobs`
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> list[str | list[int]]:
        return normalize_prompts(value)

    @model_validator(mode="after")
    def _unsupported(self):
        if self.suffix:
            raise ParamError("suffix", "suffix (insertion) is not supported by this server; leave it unset")
        if self.max_tokens == 0 and not self.echo:
            raise ParamError("max_tokens", "max_tokens 0 generates nothing; it is only allowed with echo=true "
                             "(to get the prompt back, with its logprobs if logprobs is set)")
        return self

    def prompt_logprobs_k(self) -> int | None:
        """How many alternatives per prompt token to compute: echo + logprobs (OpenAI's legacy shape,
        lm-eval's loglikelihood) and/or vLLM's `prompt_logprobs`; None when neither asks."""
        asks = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asks) if asks else None


class ChatCompletionRequest(SamplingFields):
    unsupported: ClassVar[dict[str, tuple]] = {**UNSUPPORTED, **COMPLETIONS_ONLY}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template (e.g. enable_thinking)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    thinking: dict[str, Any] | None = None  # {"type": "enabled"|"disabled"}: the template's thinking switch

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs=true")
        return self

    @model_validator(mode="after")
    def _tools_fit(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ParamError("tools", "tool function names must be unique")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ParamError("tool_choice", "tool_choice needs tools; send tools or leave tool_choice unset")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ParamError("tool_choice", f"tool_choice names {choice.function.name!r}, which is not one of "
                             f"the tools ({', '.join(names)})")
        if self.tool_mode() in ("required", "named") and self.guided() is not None:
            raise ParamError("tool_choice", "a forced tool call and a response format/guided decoding both "
                             "constrain the output; send one of them")
        return self

    def tool_mode(self) -> str:
        """none (no tools offered or tool_choice none) | auto | required | named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def tool_name(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- HTTP sampling fields -> the engine's `SamplingParams`, with engine-side validation as 400s.
#
# Only fields the client actually set are passed, so the engine's defaults stay the single source of
# truth (temperature 1.0, top_p 1.0, ...). A `SamplingError` (a ValueError carrying `.param`) from the
# engine becomes a 400 naming that param, so a range the pydantic schema does not know about is still
# reported precisely.

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the context that is left)
PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "presence_penalty",
               "frequency_penalty", "repetition_penalty")


def sampling_params(fields: SamplingFields, *, max_tokens: int, logprobs: int | None,
                    guided: dict | None = None, prompt_logprobs: int | None = None,
                    bad_words_ids: list[list[int]] | None = None, eos_token_ids: list[int] | None = None,
                    prediction_ids: list[int] | None = None) -> SamplingParams:
    """`guided`: an output constraint that overrides the fields' own (tool calls build one).
    `prompt_logprobs`: also score the prompt tokens (with this many alternatives each).
    `bad_words_ids`: the request's `bad_words` tokenized (`TokenizerService.bad_words_ids`);
    `eos_token_ids`: the tokenizer's EOS ids, masked with stop_token_ids while `min_tokens` is not reached;
    `prediction_ids`: the request's `prediction` tokenized (a draft source)."""
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "n": fields.n, "ignore_eos": fields.ignore_eos,
                              "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
                              "min_tokens": fields.min_tokens, "allowed_token_ids": fields.allowed_token_ids,
                              "bad_words_ids": bad_words_ids or [], "priority": fields.priority,
                              "skip_special_tokens": fields.skip_special_tokens,
                              "prediction_ids": prediction_ids or [],
                              "eos_token_ids": (eos_token_ids or []) if fields.min_tokens else []}
    for name in PASSTHROUGH:
        value = getattr(fields, name)
        if value is not None:
            kwargs[name] = value
    if fields.stop:
        kwargs["stop"] = list(fields.stop)
    bias = fields.logit_bias_ids()
    if bias:
        kwargs["logit_bias"] = bias
    return build_sampling_params(kwargs, fields.guided() if guided is None else guided)


def build_sampling_params(kwargs: dict[str, Any], guided: dict | None,
                          field_names: dict[str, str] | None = None) -> SamplingParams:
    """The engine's SamplingParams from `kwargs` (+ a guided-decoding spec), or a 400 naming the offending
    field; `field_names` maps an engine field to this API's name for it (Anthropic: stop -> stop_sequences).
    Every generating route builds its params here."""
    try:
        if guided is not None:
            kwargs["guided"] = GuidedDecoding(**guided)
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        param = getattr(exc, "param", None)
        param = (field_names or {}).get(param, param)
        raise APIError(400, f"invalid sampling parameters: {exc}", param=param) from exc

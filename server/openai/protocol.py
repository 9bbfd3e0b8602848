"""Request schemas (pydantic v2) of the OpenAI routes: `CompletionRequest` and `ChatCompletionRequest`,
built on the sampling fields every generating route shares (`server.generation.fields`).

Guarantees: those of `SamplingFields` (unknown fields ignored, refused fields a 400 naming them, strict
types); `prompt` is normalised to a non-empty list of prompts by a hand-written validator, so routes
never re-check it and error locations stay plain field paths (no pydantic union tags). Responses are
plain dicts built in `server.generation.formatter` and `server.openai.chat`, in OpenAI's exact shapes.
"""

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from engine.api.sampling_params import MAX_LOGPROBS
from server.generation.constraints import NamedToolChoice, Tool
from server.generation.fields import CHAT_ONLY, COMPLETIONS_ONLY, UNSUPPORTED, SamplingFields
from server.generation.messages import ChatMessage, is_token_list
from server.generation.telemetry import TelemetryFields
from server.schema import ParamError


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



class CompletionRequest(SamplingFields, TelemetryFields):
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



class ChatCompletionRequest(SamplingFields, TelemetryFields):
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


"""HTTP sampling fields -> the engine's `SamplingParams`, with engine-side validation as 400s, and the
token-id inputs of the sampler's rules (`token_rules`, `truncated`) every generating route builds.

Only fields the client actually set are passed, so the engine's defaults stay the single source of
truth (temperature 1.0, top_p 1.0, ...). A `SamplingError` (a ValueError carrying `.param`) from the
engine becomes a 400 naming that param, so a range the pydantic schema does not know about is still
reported precisely.
"""

from typing import Any

from engine.api.sampling_params import GuidedDecoding, SamplingParams
from server.errors import APIError
from server.generation.fields import SamplingFields
from server.generation.lora import lora_ref
from server.generation.telemetry import TelemetryFields
from server.state import ServerContext

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
                              "eos_token_ids": (eos_token_ids or []) if fields.min_tokens else [],
                              "lora": lora_ref(fields.model, fields.lora),
                              "report_progress": isinstance(fields, TelemetryFields) and fields.wants_progress()}
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



def truncated(prompt: list[int], body: SamplingFields) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: keep only the last k prompt tokens."""
    k = body.truncate_prompt_tokens
    return prompt[-k:] if k is not None and len(prompt) > k else prompt


async def token_rules(ctx: ServerContext, body: SamplingFields) -> dict:
    """The token-id inputs of the sampler's rules: `bad_words` tokenized, EOS ids for `min_tokens`, and the
    `prediction` tokenized (a speculative draft source)."""
    predicted = body.prediction.text() if body.prediction is not None else ""
    return {"bad_words_ids": await ctx.tokens.bad_words_ids(body.bad_words) if body.bad_words else None,
            "eos_token_ids": ctx.tokens.eos_ids() if body.min_tokens else None,
            "prediction_ids": await ctx.tokens.encode(predicted, add_special_tokens=False, param="prediction")
            if predicted else None}

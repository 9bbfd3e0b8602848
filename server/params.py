"""HTTP sampling fields -> the engine's `SamplingParams`, with engine-side validation as 400s.

Only fields the client actually set are passed, so the engine's defaults stay the single source of
truth (temperature 1.0, top_p 1.0, ...). A `SamplingError` (a ValueError carrying `.param`) from the
engine becomes a 400 naming that param, so a range the pydantic schema does not know about is still
reported precisely.
"""

from typing import Any

from engine.sampling_params import GuidedDecoding, SamplingParams
from server.errors import APIError
from server.protocol import SamplingFields

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the context that is left)
PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "presence_penalty",
               "frequency_penalty", "repetition_penalty")


def sampling_params(fields: SamplingFields, *, max_tokens: int, logprobs: int | None,
                    guided: dict | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """`guided`: an output constraint that overrides the fields' own (tool calls build one).
    `prompt_logprobs`: also score the prompt tokens (with this many alternatives each)."""
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "n": fields.n, "ignore_eos": fields.ignore_eos,
                              "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
    for name in PASSTHROUGH:
        value = getattr(fields, name)
        if value is not None:
            kwargs[name] = value
    if fields.stop:
        kwargs["stop"] = list(fields.stop)
    bias = fields.logit_bias_ids()
    if bias:
        kwargs["logit_bias"] = bias
    guided = fields.guided() if guided is None else guided
    try:
        if guided is not None:
            kwargs["guided"] = GuidedDecoding(**guided)
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"invalid sampling parameters: {exc}", param=getattr(exc, "param", None)) from exc

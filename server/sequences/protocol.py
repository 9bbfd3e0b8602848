"""Request schemas of the sequence routes (create, continue, fork, truncate); the sequence object they
answer with is `server.generation.sequence_view`. The schemas share `server.schema`'s base (strict types, explicit null =
default) and, for a sequence continuation, `server.generation.fields`' sampling fields and refused-field
tables; `PromptOrMessages` (exactly one prompt or chat messages, `server.generation.messages`) is
`/tokenize`'s base too."""

from typing import ClassVar

from pydantic import Field, model_validator

from engine.api.sampling_params import MAX_LOGPROBS
from server.generation.fields import CHAT_ONLY, COMPLETIONS_ONLY, UNSUPPORTED, SamplingFields
from server.generation.messages import PromptOrMessages
from server.schema import ParamError, StrictModel


class SequenceCreateRequest(PromptOrMessages):
    model: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        self._require_exactly_one()
        if self.messages is not None and not self.messages:
            raise ParamError("messages", "messages must not be empty")
        return self


class SequenceCompletionRequest(SamplingFields, PromptOrMessages):
    """Append optional text to a sequence, then generate into it (one choice: n must be 1)."""

    # truncate_prompt_tokens would cut the sequence's history: that is POST /v1/sequences/{id}/truncate's job.
    unsupported: ClassVar[dict[str, tuple]] = {**UNSUPPORTED, **CHAT_ONLY, **COMPLETIONS_ONLY,
                                               "truncate_prompt_tokens": ()}

    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _at_most_one(self):
        if self.prompt == "":  # the openai SDK always sends a prompt; "" means "append no text"
            self.prompt = None
        if self.prompt is not None and self.messages is not None:
            raise ParamError("prompt", "give at most one of prompt or messages")
        if self.n != 1:
            raise ParamError("n", "a sequence generates one continuation at a time; fork it for more (n must be 1)")
        return self


class ForkRequest(StrictModel):
    at: int | None = Field(None, ge=0)
    model: str | None = None  # a LoRA adapter's name: the fork runs under it (recomputed); else the parent's


class TruncateRequest(StrictModel):
    length: int = Field(ge=0)

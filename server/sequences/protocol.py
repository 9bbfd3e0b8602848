"""Request schemas of the sequence routes (create, continue, fork, truncate) and the sequence object they
answer with (`sequence_view`). The schemas share `server.schema`'s base (strict types, explicit null =
default) and, for a sequence continuation, `server.openai.protocol`'s sampling fields and refused-field
tables; `PromptOrMessages` (exactly one prompt or chat messages) is `/tokenize`'s base too."""

import time
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from engine.api.outputs import SequenceInfo
from engine.api.sampling_params import MAX_LOGPROBS
from server.openai.protocol import (
    CHAT_ONLY,
    COMPLETIONS_ONLY,
    UNSUPPORTED,
    ChatMessage,
    SamplingFields,
    is_token_list,
)
from server.schema import ParamError, StrictModel


def normalize_single_prompt(value: Any) -> str | list[int] | None:
    """str | list[int] | None: one prompt (sequences and tokenize take exactly one)."""
    if value is None or isinstance(value, str):
        return value
    if is_token_list(value) and value:
        return list(value)
    raise ValueError("prompt must be a string or a non-empty list of non-negative token ids")


class PromptOrMessages(StrictModel):
    """Exactly one prompt (text or token ids) or chat messages: a sequence's input, and /tokenize's."""

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> str | list[int] | None:
        return normalize_single_prompt(value)

    def _require_exactly_one(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "give exactly one of prompt or messages")


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


class TruncateRequest(StrictModel):
    length: int = Field(ge=0)


def _epoch(monotonic_t: float) -> float:
    """`last_used` is a time.monotonic() stamp (TTL arithmetic); clients want wall-clock seconds."""
    return round(time.time() - (time.monotonic() - monotonic_t), 3)


def sequence_view(info: SequenceInfo, text: str | None = None, with_tokens: bool = False) -> dict:
    out = {
        "id": info.seq_id,
        "object": "sequence",
        "length": info.length,
        "status": info.status,
        "parent": info.parent,
        # cached_tokens: with cells in the pool; saved_tokens: with cells in the state dir (--state-dir), which
        # load when the sequence next runs instead of being recomputed
        "cells": {"owned": info.cells_owned, "shared": info.cells_shared, "cached_tokens": info.n_cached,
                  "saved_tokens": info.n_saved},
        "created": int(info.created),  # already wall-clock (time.time())
        "last_used": _epoch(info.last_used),
    }
    if with_tokens:
        out["token_ids"] = list(info.token_ids)
    if text is not None:
        out["text"] = text
    return out

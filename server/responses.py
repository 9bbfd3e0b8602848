"""OpenAI response and stream-chunk shapes, built as plain dicts from per-choice state.

Guarantees: the field names, nesting and `object` values match OpenAI's `text_completion`,
`chat.completion` and `chat.completion.chunk` objects, so the `openai` SDK parses them unchanged;
`usage` counts the prompt once per prompt (not once per choice); logprobs follow the legacy
completions shape (`tokens`/`token_logprobs`/`top_logprobs`/`text_offset`) or the chat shape
(`content: [{token, logprob, bytes, top_logprobs}]`). Nothing here touches the engine or tokenizes
text; token strings come from the injected `token_str` callable.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.outputs import SequenceInfo, TokenLogprob

TokenStr = Callable[[int], str]


@dataclass
class ChoiceState:
    """Everything one choice has produced so far (text and tokens accumulate; deltas are separate)."""

    index: int
    prompt_index: int
    prefix: str = ""  # echoed prompt text (completions with echo=true)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    lp_chars: int = 0  # characters of token strings already streamed (text_offset of the next token)


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: prompt tokens whose cells came from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(lps: list[TokenLogprob], token_str: TokenStr, offset: int) -> dict:
    """Legacy completions logprobs; `offset` is the text offset of the first token in the choice."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        s = token_str(lp.token_id)
        tokens.append(s)
        values.append(lp.logprob)
        top = {token_str(t): v for t, v in lp.top}
        top.setdefault(s, lp.logprob)  # OpenAI always includes the sampled token
        tops.append(top)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(plp, token_str: TokenStr) -> dict:
    """Legacy completions logprobs of the echoed prompt (an `engine.outputs.PromptLogprobs`): the first
    token's logprob and top_logprobs are null, as OpenAI and vLLM answer."""
    tokens = [token_str(t) for t in plp.token_ids]
    tops, offsets, offset = [], [], 0
    for s, lp, top in zip(tokens, plp.logprobs, plp.top):
        if top is None:
            tops.append(None)
        else:
            d = {token_str(t): v for t, v in top}
            d.setdefault(s, lp)
            tops.append(d)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": list(plp.logprobs), "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(plp, token_str: TokenStr, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id (as a string):
    {logprob, rank, decoded_token}} holding the prompt token and the k most likely ones."""
    out: list[dict | None] = []
    for tok, lp, rank, top in zip(plp.token_ids, plp.logprobs, plp.ranks, plp.top):
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": v, "rank": r, "decoded_token": token_str(t)}
                 for r, (t, v) in enumerate(top[:k], start=1)}
        entry.setdefault(str(tok), {"logprob": lp, "rank": rank, "decoded_token": token_str(tok)})
        out.append(entry)
    return out


def join_logprobs(first: dict | None, then: dict) -> dict:
    if first is None:
        return then
    return {k: first[k] + then[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _chat_entry(token_id: int, logprob: float, token_str: TokenStr) -> dict:
    s = token_str(token_id)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(lps: list[TokenLogprob], token_str: TokenStr) -> dict:
    content = []
    for lp in lps:
        entry = _chat_entry(lp.token_id, lp.logprob, token_str)
        entry["top_logprobs"] = [_chat_entry(t, v, token_str) for t, v in lp.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_response(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": use, "system_fingerprint": None}


def completion_choice(c: ChoiceState, token_str: TokenStr, want_logprobs: bool, prompt_lp: dict | None = None) -> dict:
    """`prompt_lp`: the echoed prompt's logprobs (`prompt_logprobs`), put before the generated ones."""
    lp = join_logprobs(prompt_lp, completion_logprobs(c.logprobs, token_str, len(c.prefix))) if want_logprobs else None
    return {"index": c.index, "text": c.prefix + c.text, "logprobs": lp, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}


def chat_response(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": use, "system_fingerprint": None}


def chat_choice(c: ChoiceState, token_str: TokenStr, want_logprobs: bool, content: str | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    """`content`/`tool_calls`: the text split by `server.tools` when tools were offered (else the text)."""
    calls = tool_calls or []
    finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
    return {
        "index": c.index,
        "message": {"role": "assistant", "content": c.text if content is None and not calls else content,
                    "refusal": None, "tool_calls": calls},
        "logprobs": chat_logprobs(c.logprobs, token_str) if want_logprobs else None,
        "finish_reason": finish,
        "stop_reason": c.stop_reason,
    }


def chunk(obj: str, rid: str, created: int, model: str, choices: list[dict], with_usage: bool) -> dict:
    """One stream chunk; `usage: null` is present on every chunk iff include_usage was asked for."""
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
           "system_fingerprint": None}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(obj: str, rid: str, created: int, model: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use,
            "system_fingerprint": None}


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
        "cells": {"owned": info.cells_owned, "shared": info.cells_shared, "cached_tokens": info.n_cached},
        "created": int(info.created),  # already wall-clock (time.time())
        "last_used": _epoch(info.last_used),
    }
    if with_tokens:
        out["token_ids"] = list(info.token_ids)
    if text is not None:
        out["text"] = text
    return out

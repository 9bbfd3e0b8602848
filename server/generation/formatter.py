"""OpenAI response and stream-chunk shapes, built as plain dicts from per-choice state by a `Formatter`
(what `/v1/completions` and sequence continuations answer; chat's formatter builds on it).

Guarantees: the field names, nesting and `object` values match OpenAI's `text_completion`,
`chat.completion` and `chat.completion.chunk` objects, so the `openai` SDK parses them unchanged;
`usage` counts the prompt once per prompt (not once per choice); logprobs follow the legacy
completions shape (`tokens`/`token_logprobs`/`top_logprobs`/`text_offset`) or the chat shape
(`content: [{token, logprob, bytes, top_logprobs}]`). Nothing here touches the engine or tokenizes
text; token strings come from the injected `token_str` callable, the model name is given.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.api.outputs import CompletionOutput, RequestOutput, TokenLogprob
from server.generation.run import GenerationRun
from server.generation.telemetry import Telemetry

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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          drafts: tuple[int, int] = (0, 0), predicted: bool = False) -> dict:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: prompt tokens whose cells came from the prefix
    cache. Drafted tokens kept / rejected (when speculative decoding drafted) go to OpenAI's
    `completion_tokens_details.accepted/rejected_prediction_tokens` only when the request sent a `prediction`
    (OpenAI's Predicted Outputs, the one meaning those fields have); otherwise to cellserve's own
    `cellserve_draft_tokens` (clients read OpenAI's fields as tokens paid for and wasted)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if any(drafts) and predicted:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": drafts[0],
                                            "rejected_prediction_tokens": drafts[1]}
    elif any(drafts):
        out["cellserve_draft_tokens"] = {"accepted": drafts[0], "rejected": drafts[1]}
    return out


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
    """Legacy completions logprobs of the echoed prompt (an `engine.api.outputs.PromptLogprobs`): the first
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


# OpenAI's `system_fingerprint`: the backend build a response came from (llama.cpp's form, `b<build>`; /props says
# the same build)
SYSTEM_FINGERPRINT = "b0.1.0-cellserve"


def join_logprobs(first: dict | None, then: dict) -> dict:
    if first is None:
        return then
    return {k: first[k] + then[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def completion_response(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": use, "system_fingerprint": SYSTEM_FINGERPRINT}


def completion_choice(c: ChoiceState, token_str: TokenStr, want_logprobs: bool, prompt_lp: dict | None = None) -> dict:
    """`prompt_lp`: the echoed prompt's logprobs (`prompt_logprobs`), put before the generated ones."""
    lp = join_logprobs(prompt_lp, completion_logprobs(c.logprobs, token_str, len(c.prefix))) if want_logprobs else None
    return {"index": c.index, "text": c.prefix + c.text, "logprobs": lp, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}


def chunk(obj: str, rid: str, created: int, model: str, choices: list[dict], with_usage: bool) -> dict:
    """One stream chunk; `usage: null` is present on every chunk iff include_usage was asked for."""
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
           "system_fingerprint": SYSTEM_FINGERPRINT}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(obj: str, rid: str, created: int, model: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use,
            "system_fingerprint": SYSTEM_FINGERPRINT}


class Formatter:
    """How one endpoint shapes choices and chunks (completions vs chat)."""

    chunk_object = "text_completion"

    def __init__(self, run: GenerationRun, *, model: str, token_str: TokenStr, n: int, want_logprobs: bool,
                 include_usage: bool = False, prefixes: list[str] | None = None, extra: dict | None = None,
                 vllm_prompt_logprobs: int | None = None, include_stop_str: bool = False):
        """`model`: the model name the answers carry; `token_str`: a token id's text (for logprobs).
        `vllm_prompt_logprobs`: add vLLM's per-choice `prompt_logprobs` (k alternatives per token).
        `include_stop_str`: a choice ended by a stop string keeps that string at the end of its text."""
        self.run, self.model, self.token_str = run, model, token_str
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.created = now()
        self.extra = extra or {}
        self.echo = prefixes is not None
        self.cached: dict[int, int] = {}  # prompt index -> its cached prompt tokens
        self.drafts: dict[int, tuple[int, int]] = {}  # prompt index -> drafted tokens (kept, rejected)
        self.prompt_lps: dict[int, dict] = {}  # prompt index -> its echoed prompt's logprobs
        self.vllm_k = vllm_prompt_logprobs
        self.include_stop_str = include_stop_str
        self.vllm_lps: dict[int, list] = {}  # prompt index -> vLLM-shaped prompt_logprobs
        self.telemetry: Telemetry | None = None  # llama.cpp's timings/prompt_progress, when the request asked
        self.progress: dict | None = None  # the `prompt_progress` the last output carried (telemetry on)
        self.verbose_prompt: str | None = None  # llama.cpp's `verbose`: the prompt's text, for `__verbose`
        self.states = {
            (k, i): ChoiceState(index=k * n + i, prompt_index=k, prefix=(prefixes or [""] * len(run.prompts))[k])
            for k in range(len(run.prompts)) for i in range(n)
        }

    def apply(self, k: int, co: CompletionOutput) -> ChoiceState:
        st = self.states[(k, co.index)]
        if self.include_stop_str and co.finish_reason == "stop" and isinstance(co.stop_reason, str):
            co.text += co.stop_reason
        st.text += co.text
        st.token_ids += co.token_ids
        if co.logprobs:
            st.logprobs += co.logprobs
        if co.finish_reason:
            st.finish_reason, st.stop_reason, st.error = co.finish_reason, co.stop_reason, co.error
        return st

    def total_usage(self) -> dict:
        return usage(self.run.prompt_tokens(), sum(len(s.token_ids) for s in self.states.values()),
                     sum(self.cached.values()), tuple(map(sum, zip((0, 0), *self.drafts.values()))),
                     predicted=bool(self.run.params.prediction_ids))

    def fold(self, k: int, out: RequestOutput) -> None:
        """Fold one engine output of prompt `k` into the choices (a whole answer's `driver.collect`)."""
        self.note(k, out)
        for co in out.outputs:
            self.apply(k, co)

    def note(self, k: int, out: RequestOutput) -> None:
        """Per-request facts carried by every output (prompt tokens served from the prefix cache)."""
        self.cached[k] = out.cached_tokens
        self.progress = self.telemetry.note(out) if self.telemetry is not None else None
        self.drafts[k] = (out.accepted_draft_tokens, out.rejected_draft_tokens)
        plp = out.prompt_logprobs
        if plp is not None:  # once per prompt
            if self.want_logprobs and self.echo:
                self.prompt_lps[k] = prompt_logprobs(plp, self.token_str)
            if self.vllm_k is not None:
                self.vllm_lps[k] = vllm_prompt_logprobs(plp, self.token_str, self.vllm_k)

    def ordered(self) -> list[ChoiceState]:
        return sorted(self.states.values(), key=lambda s: s.index)

    # completions shapes (ChatFormatter overrides)
    def final(self) -> dict:
        choices = [completion_choice(s, self.token_str, self.want_logprobs,
                                     self.prompt_lps.get(s.prompt_index)) for s in self.ordered()]
        if self.vllm_k is not None:
            for choice, s in zip(choices, self.ordered()):
                choice["prompt_logprobs"] = self.vllm_lps.get(s.prompt_index)
        body = completion_response(self.run.request_id, self.created, self.model, choices,
                                   self.total_usage())
        return {**body, **self.extra}

    def opening_chunks(self) -> list[dict]:
        return []

    def progress_chunk(self, progress: dict) -> dict:
        """llama.cpp's `prompt_progress` event: a chunk with no choice (a delta would repeat the role, which
        the `openai` SDK's stream accumulator concatenates), `timings` with `timings_per_token`."""
        return self.telemetry.stamp({**self._chunk([]), "prompt_progress": progress})

    def delta_chunk(self, st: ChoiceState, co: CompletionOutput, first: bool) -> dict:
        lp = None
        if self.want_logprobs:
            lp = completion_logprobs(co.logprobs or [], self.token_str, len(st.prefix) + st.lp_chars)
            st.lp_chars += sum(len(t) for t in lp["tokens"])
            if first:
                lp = join_logprobs(self.prompt_lps.get(st.prompt_index), lp)
        text = (st.prefix if first else "") + co.text
        choice = {"index": st.index, "text": text, "logprobs": lp, "finish_reason": co.finish_reason,
                  "stop_reason": co.stop_reason}
        if first and self.vllm_k is not None:
            choice["prompt_logprobs"] = self.vllm_lps.get(st.prompt_index)
        return self._chunk([choice])

    def _chunk(self, choices: list[dict]) -> dict:
        out = chunk(self.chunk_object, self.run.request_id, self.created, self.model, choices,
                    self.include_usage)
        return {**out, **self.extra}

"""Output processing: a sampled token becomes text, a finish, and a `RequestOutput` delta.

`OutputProcessor` holds the rule for a choice's next token (engine side): append it, feed the
grammar, decide the finish (EOS, stop-token ids, max_tokens, a complete grammar, a stop string), and
detokenize by `choice_text` (the one text rule, which `OutputDetokenizer` applies off the engine
thread for requests that asked for no engine-side text). It also ends choices (asking the scheduler
to retire, idle or release their sequence) and emits each request's delta exactly once per tick,
with every finish reported once.
"""

from __future__ import annotations

import logging
import time
from collections import abc

from engine.api.outputs import CompletionOutput, PromptProgress, RequestOutput, TokenLogprob
from engine.api.sampling_params import SamplingParams
from engine.core.detokenizer import choice_text
from engine.core.plan import Chunk, SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.core.sequence import Choice, Request

log = logging.getLogger("cellserve.engine")



def check_stop_token(params: SamplingParams, token_id: int, num_generated: int,
                     eos_token_ids: abc.Sequence[int] = ()) -> tuple[str, int | None] | None:
    """Token-level stop check after `token_id` became the `num_generated`-th output token.

    Returns (finish_reason, stop_reason) as in vLLM: ("stop", token_id) for a stop_token_id, ("stop", None)
    for EOS (unless ignore_eos), ("length", None) at max_tokens, else None (keep going). A stop or EOS
    token stays in the output token ids but its text should not be pushed to the detokenizer. Stop
    *strings* are the detokenizer's job (engine/core/detokenizer.py).
    """
    if num_generated <= params.min_tokens:  # the sampler masks these until min_tokens; never stop early
        return ("length", None) if num_generated >= params.max_tokens else None
    if token_id in params.stop_token_ids:
        return "stop", token_id
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop", None
    if num_generated >= params.max_tokens:
        return "length", None
    return None


class OutputProcessor:
    """Turns tokens into outputs for the engine's in-flight `requests` (it drops a request from that
    dict once its last choice has finished and been reported)."""

    def __init__(self, scheduler: Scheduler, requests: dict[str, Request], eos_ids: list[int]):
        self.scheduler = scheduler
        self.requests = requests
        self.eos_ids = eos_ids

    def append(self, choice: Choice, token: int, lp: TokenLogprob | None) -> CompletionOutput:
        """`token` becomes the choice's next output token (its sequence's truth); the choice ends on a stop."""
        req = choice.request
        choice.seq.token_ids.append(token)
        if req.metrics.timing.first_token is None:
            req.metrics.timing.first_token = time.monotonic()
        out = CompletionOutput(choice.index, [token], logprobs=[lp] if lp else None)
        stop = check_stop_token(choice.params, token, choice.num_generated, self.eos_ids)
        if choice.grammar is not None:
            choice.grammar.accept(token)
            if choice.grammar.terminated:  # the grammar was complete and took EOS: the choice is done
                stop = ("stop", None)
        if choice.detok is not None:
            out.text = choice_text(choice.detok, [token], stop[0] if stop else None)
            if choice.detok.stopped:  # the token completed a stop string: the text is cut before it
                stop = ("stop", choice.detok.stop_reason)
        if stop is not None:
            out.finish_reason, out.stop_reason = stop
            self.finish(choice, stop[0])
        return out

    def append_kept(self, choice: Choice, tokens: list[int], lps: list, deltas: dict[int, CompletionOutput]) -> int:
        """A verified draft's tokens, in order, until one ends the choice; merged into the choice's one delta of
        this tick (`deltas`: index -> delta). Returns how many were appended."""
        kept = 0
        for token, lp in zip(tokens, lps):
            _merge(deltas, choice.index, self.append(choice, token, lp))
            kept += 1
            if not choice.live:  # finished on this token
                break
        return kept

    def count_drafts(self, req: Request, accepted: int, rejected: int) -> None:
        """Drafted tokens of `req` kept and refused by a verification (reported in its usage)."""
        req.metrics.accepted_draft_tokens += accepted
        req.metrics.rejected_draft_tokens += rejected

    def scheduled(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """A plan was made: each request's `cached_tokens` (OpenAI's usage field) is its prompt tokens found in
        the cache at its first admission (re-admissions after a preemption do not count again), and prefill-only
        requests done without a forward end. Returns the outputs this made."""
        outputs: list[RequestOutput] = []
        for seq, shared in plan.cached:
            req = seq.request
            if req is not None and seq.choice.index == 0 and req.metrics.cached_tokens is None:
                history = len(seq.token_ids) - len(req.prompt_ids)
                req.metrics.cached_tokens = max(0, shared - history)
                req.metrics.timing.prompt_started = time.monotonic()
                if req.params.report_progress:  # nothing prefilled yet: what the cache held
                    outputs.append(self.emit(req, {}, progress=req.metrics.cached_tokens))
        self.finish_prefills(outputs)
        return outputs

    def progress(self, chunks: list[Chunk], outputs: list[RequestOutput]) -> None:
        """A forward ran `chunks`: each request that asked (`report_progress`) and was still prefilling its prompt
        gets an output saying how many prompt tokens have cells now (before the token its last chunk samples)."""
        for c in chunks:
            choice = c.seq.choice
            if choice is None or choice.index or choice.num_generated or not choice.request.params.report_progress:
                continue
            req = choice.request
            done = c.seq.n_cached - choice.gen_start + len(req.prompt_ids)
            outputs.append(self.emit(req, {}, progress=min(max(done, 0), len(req.prompt_ids))))

    def finish(self, choice: Choice, reason: str, error: str | None = None) -> None:
        """End one choice: it keeps its reason, and the scheduler takes its sequence (no choice runs on it)."""
        choice.finish_reason, choice.error = reason, error
        choice.grammar = None
        self.scheduler.finish(choice.seq, reason)

    def emit(self, req: Request, choices: dict[int, CompletionOutput], embedding: list[float] | None = None,
             progress: int | None = None) -> RequestOutput:
        """Send `req` this tick's delta: the new tokens of `choices`, plus a finish for every choice that
        ended without a token (cancel, error) and was not reported yet (`embedding`: an embedding's vector;
        `progress`: its prompt tokens with cells now, sent as `prompt_progress`)."""
        for ch in req.choices:
            if ch.index not in choices and not ch.live and ch.index not in req.reported:
                choices[ch.index] = CompletionOutput(ch.index, finish_reason=ch.finish_reason, error=ch.error)
        if req.children_pending and not req.live():
            _end_unforked(req, choices)
        req.reported.update(i for i, c in choices.items() if c.finish_reason)
        finished = not req.live()
        if finished and not req.finished:
            req.finished = True
            req.metrics.timing.finished = time.monotonic()
            self.requests.pop(req.request_id, None)
        plp = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            plp, req.prompt_logprobs_sent = req.prompt_logprobs, True
        seq_id = req.persistent_seq.seq_id if req.persistent_seq else None
        m = req.metrics
        out = RequestOutput(req.request_id, sorted(choices.values(), key=lambda c: c.index), req.prompt_ids,
                            finished, seq_id, m.timing, m.cached_tokens or 0, prompt_logprobs=plp,
                            accepted_draft_tokens=m.accepted_draft_tokens,
                            rejected_draft_tokens=m.rejected_draft_tokens, embedding=embedding)
        if progress is not None:
            out.prompt_progress = PromptProgress(len(req.prompt_ids), m.cached_tokens or 0, progress, time.monotonic())
        req.emit(out)
        return out

    def cancel(self, req: Request) -> RequestOutput:
        for seq in req.live():
            self.finish(seq.choice, "cancelled")
        return self.emit(req, {})

    def finish_prefills(self, outputs: list[RequestOutput]) -> None:
        """Prefill-only requests (sequence create, max_tokens 0) end once their cache target is reached,
        with finish_reason `length`: they have generated all max_tokens = 0 of their tokens."""
        for seq in list(self.scheduler.running):
            req = seq.request
            if req is not None and req.prefill_only and not req.pooling and seq.n_cached >= seq.cache_target():
                self.finish(seq.choice, "length")
                outputs.append(self.emit(req, {}))

    def fail_step(self, chunks: list[Chunk], exc: Exception, outputs: list[RequestOutput]) -> None:
        failed = {c.seq.request for c in chunks if c.seq.request is not None}
        log.error("failing requests %s: %s: %s", sorted(r.request_id for r in failed), type(exc).__name__, exc)
        for req in failed:
            self.fail_request(req, exc, outputs)

    def fail_request(self, req: Request, exc: Exception, outputs: list[RequestOutput]) -> None:
        for seq in req.live():
            self.finish(seq.choice, "error", f"{type(exc).__name__}: {exc}")
        outputs.append(self.emit(req, {}))


def _merge(choices: dict[int, CompletionOutput], index: int, out: CompletionOutput) -> None:
    """Several tokens of one choice in one tick become one delta."""
    prev = choices.get(index)
    if prev is None:
        choices[index] = out
        return
    prev.token_ids = [*prev.token_ids, *out.token_ids]
    prev.text += out.text
    if out.logprobs:
        prev.logprobs = [*(prev.logprobs or []), *out.logprobs]
    prev.finish_reason, prev.stop_reason = out.finish_reason, out.stop_reason


def _end_unforked(req: Request, choices: dict[int, CompletionOutput]) -> None:
    """n > 1 ended (cancel, failed forward) before its prompt was prefilled and forked: the choices that
    were never forked end the same way as choice 0, so every one of the n choices reports a finish."""
    first = req.choices[0]
    for i in range(1, req.children_pending + 1):
        choices[i] = CompletionOutput(i, finish_reason=first.finish_reason, error=first.error)
    req.children_pending = 0


# ----- detokenization ----------------------------------------------------------------------------

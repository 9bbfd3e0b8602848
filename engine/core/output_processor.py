"""Output processing: a sampled token becomes text, a finish, and a `RequestOutput` delta.

`OutputProcessor` holds the rule for a choice's next token (engine side): append it, feed the
grammar, decide the finish (EOS, stop-token ids, max_tokens, a complete grammar, a stop string), and
detokenize by `choice_text` (the one text rule, which `OutputDetokenizer` applies off the engine
thread for requests that asked for no engine-side text). It also ends choices (asking the scheduler
to retire, idle or release their sequence) and emits each request's delta exactly once per tick,
with every finish reported once.

Detokenization is incremental and UTF-8-safe, with stop strings. Decoding token by token is wrong
twice over: a byte-level BPE token may hold half a UTF-8 character, and SentencePiece-style tokenizers
drop the leading space of the first token they decode. The prefix/read offset method of vLLM and HF
TGI fixes both: decode a small window of already-emitted tokens (the "prefix") alone and together with
the new tokens, and emit the difference; hold everything back while the new decode ends with U+FFFD,
the mark of an incomplete byte sequence. Stop strings are matched on the emitted text. Text that could
still be the start of a stop string is held back until it cannot be, so a stop string is never
half-sent before it is recognised.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import abc

from engine.api.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.core.scheduler import Chunk, Scheduler
from engine.core.sequence import Request, Sequence
from engine.sample.sampler import check_stop_token

log = logging.getLogger("cellserve.engine")
REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output token (vLLM's choice)


class OutputProcessor:
    """Turns tokens into outputs for the engine's in-flight `requests` (it drops a request from that
    dict once its last choice has finished and been reported)."""

    def __init__(self, scheduler: Scheduler, requests: dict[str, Request], eos_ids: list[int]):
        self.scheduler = scheduler
        self.requests = requests
        self.eos_ids = eos_ids

    def append(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> CompletionOutput:
        req = seq.request
        seq.token_ids.append(token)
        if req.timing.first_token is None:
            req.timing.first_token = time.monotonic()
        out = CompletionOutput(seq.index, [token], logprobs=[lp] if lp else None)
        stop = check_stop_token(seq.params, token, seq.num_generated, self.eos_ids)
        if seq.grammar is not None:
            seq.grammar.accept(token)
            if seq.grammar.terminated:  # the grammar was complete and took EOS: the choice is done
                stop = ("stop", None)
        if seq.detok is not None:
            out.text = choice_text(seq.detok, [token], stop[0] if stop else None)
            if seq.detok.stopped:  # the token completed a stop string: the text is cut before it
                stop = ("stop", seq.detok.stop_reason)
        if stop is not None:
            out.finish_reason, out.stop_reason = stop
            self.finish(seq, stop[0])
        return out

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End one choice: it keeps its reason, leaves its request, and the scheduler takes its sequence."""
        seq.finish_reason, seq.error = reason, error
        seq.request = seq.grammar = None
        self.scheduler.finish(seq, reason)

    def emit(self, req: Request, choices: dict[int, CompletionOutput]) -> RequestOutput:
        """Send `req` this tick's delta: the new tokens of `choices`, plus a finish for every choice that
        ended without a token (cancel, error) and was not reported yet."""
        for seq in req.seqs:
            if seq.index not in choices and seq.request is None and seq.index not in req.reported:
                choices[seq.index] = CompletionOutput(seq.index, finish_reason=seq.finish_reason, error=seq.error)
        if req.children_pending and not req.live():
            _end_unforked(req, choices)
        req.reported.update(i for i, c in choices.items() if c.finish_reason)
        finished = not req.live()
        if finished and not req.finished:
            req.finished = True
            req.timing.finished = time.monotonic()
            self.requests.pop(req.request_id, None)
        plp = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            plp, req.prompt_logprobs_sent = req.prompt_logprobs, True
        seq_id = req.persistent_seq.seq_id if req.persistent_seq else None
        out = RequestOutput(req.request_id, sorted(choices.values(), key=lambda c: c.index), req.prompt_ids,
                            finished, seq_id, req.timing, req.cached_tokens or 0, prompt_logprobs=plp)
        req.emit(out)
        return out

    def cancel(self, req: Request) -> RequestOutput:
        for seq in req.live():
            self.finish(seq, "cancelled")
        return self.emit(req, {})

    def finish_prefills(self, outputs: list[RequestOutput]) -> None:
        """Prefill-only requests (sequence create, max_tokens 0) end once their cache target is reached,
        with finish_reason `length`: they have generated all max_tokens = 0 of their tokens."""
        for seq in list(self.scheduler.running):
            req = seq.request
            if req is not None and req.prefill_only and seq.n_cached >= seq.cache_target():
                self.finish(seq, "length")
                outputs.append(self.emit(req, {}))

    def fail_step(self, chunks: list[Chunk], exc: Exception, outputs: list[RequestOutput]) -> None:
        failed = {c.seq.request for c in chunks if c.seq.request is not None}
        log.error("failing requests %s: %s: %s", sorted(r.request_id for r in failed), type(exc).__name__, exc)
        for req in failed:
            self.fail_request(req, exc, outputs)

    def fail_request(self, req: Request, exc: Exception, outputs: list[RequestOutput]) -> None:
        for seq in req.live():
            self.finish(seq, "error", f"{type(exc).__name__}: {exc}")
        outputs.append(self.emit(req, {}))


def _end_unforked(req: Request, choices: dict[int, CompletionOutput]) -> None:
    """n > 1 ended (cancel, failed forward) before its prompt was prefilled and forked: the choices that
    were never forked end the same way as choice 0, so every one of the n choices reports a finish."""
    first = req.seqs[0]
    for i in range(1, req.children_pending + 1):
        choices[i] = CompletionOutput(i, finish_reason=first.finish_reason, error=first.error)
    req.children_pending = 0


# ----- detokenization ----------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas, one `push` per engine step.

    Guarantees:
    - the concatenation of every `push` and the final `flush` equals `tokenizer.decode(output_ids)` (as
      it reads after the prompt, i.e. with the prompt's context for leading spaces), cut at the first
      stop string;
    - no delta ends inside a multibyte character: a trailing U+FFFD from an incomplete byte sequence is
      held back until the following tokens complete it (or `flush` gives it up as it is);
    - the first occurrence of any stop string and everything after it is never returned; `stopped`
      becomes True and `stop_reason` holds the matched string; later pushes are ignored and return "".

    Decoding uses `skip_special_tokens` as given and never applies `clean_up_tokenization_spaces`
    (it would rewrite already-emitted text). The engine should not push EOS / stop-token ids.
    """

    def __init__(self, tokenizer, prompt_ids: abc.Sequence[int] = (), skip_special_tokens: bool = True,
                 stop: abc.Sequence[str] = ()):
        if isinstance(stop, str):
            stop = [stop]
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty; drop the empty string from `stop`")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._ids = self._context(context_ids(prompt_ids))  # context + output tokens
        self._n_context = len(self._ids)
        self._prefix_offset = 0  # start of the already-emitted tokens decoded as context
        self._read_offset = self._n_context  # first token whose text has not been emitted yet
        self._pending = ""  # decoded text held back because it may begin a stop string
        self.text = ""  # everything returned so far
        self.stopped = False
        self.stop_reason: str | None = None
        self._flushed = False

    @property
    def output_ids(self) -> list[int]:
        """Every token id pushed so far (including ones after a stop string)."""
        return self._ids[self._n_context:]

    def push(self, token_ids: int | abc.Sequence[int]) -> str:
        """Add one or more generated token ids; return the newly safe text (possibly "")."""
        if self._flushed:
            raise RuntimeError("push() after flush(): make a new IncrementalDetokenizer per generation")
        self._ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        if self.stopped:
            return ""
        return self._emit(self._decode_delta(final=False), final=False)

    def flush(self) -> str:
        """End of generation: return everything still held back (an incomplete character, a possible
        stop-string prefix), still cut at a stop string. Further pushes raise."""
        if self._flushed:
            return ""
        self._flushed = True
        if self.stopped:
            return ""
        return self._emit(self._decode_delta(final=True), final=True)

    def _context(self, prompt: list[int]) -> list[int]:
        """The last CONTEXT_TOKENS prompt tokens, moved back (at most 3 tokens) so that the window does
        not start inside a character: stray continuation bytes decode as U+FFFD and, with byte-fallback
        decoders (<0xNN> pieces), spoil the decode of the whole byte run they belong to."""
        start = max(len(prompt) - CONTEXT_TOKENS, 0)
        for _ in range(3):
            if start == 0 or not self._decode(prompt[start:]).startswith(REPLACEMENT_CHAR):
                break
            start -= 1
        return prompt[start:]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_delta(self, final: bool) -> str:
        """Text of the unread tokens, by difference of two decodes sharing the prefix window."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""  # nothing visible yet, or a character is still incomplete: wait for more tokens
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text):]

    def _emit(self, delta: str, final: bool) -> str:
        """Pass decoded text through the stop-string filter; return what is safe to send."""
        buf = self._pending + delta
        hit = self._find_stop(buf)
        if hit is not None:
            index, self.stop_reason = hit
            self.stopped = True
            out, self._pending = buf[:index], ""
        else:
            keep = 0 if final else self._partial_stop_len(buf)
            out, self._pending = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self.text += out
        return out

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        """The earliest stop-string occurrence in buf (index, string), first listed on a tie."""
        hits = [(buf.find(s), i) for i, s in enumerate(self.stop) if s in buf]
        if not hits:
            return None
        index, i = min(hits)
        return index, self.stop[i]

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string: one set
        lookup per candidate length, so the cost does not grow with the number of stop strings."""
        prefixes = _proper_prefixes(tuple(self.stop))
        for k in range(min(len(buf), self._max_stop - 1), 0, -1):
            if buf[-k:] in prefixes:
                return k
        return 0


@functools.lru_cache(maxsize=256)
def _proper_prefixes(stop: tuple[str, ...]) -> frozenset[str]:
    """Every non-empty proper prefix of every stop string (shared by the n choices of a request)."""
    return frozenset(s[:k] for s in stop for k in range(1, len(s)))


def context_ids(token_ids: abc.Sequence[int]) -> list[int]:
    """The tail of a sequence's tokens that `IncrementalDetokenizer` reads as context."""
    return list(token_ids[-(CONTEXT_TOKENS + 3):])


def choice_text(detok: IncrementalDetokenizer, token_ids: list[int], finish_reason: str | None) -> str:
    """The text a choice's new tokens add, by the one rule both the engine and `OutputDetokenizer` use:
    the token that ends a choice with `stop` (EOS, a stop-token id, a complete grammar) carries no text,
    and a choice that ends by `stop` or `length` flushes what the detokenizer held back (a cancelled or
    failed one does not)."""
    ids = token_ids[:-1] if finish_reason == "stop" else token_ids
    text = detok.push(ids) if ids else ""
    if finish_reason in ("stop", "length"):
        text += detok.flush()
    return text


class OutputDetokenizer:
    """Fills in the `text` of one request's outputs, on the consumer's thread instead of the engine's.

    For a request the engine ran with `detokenize=False` (no stop strings), it feeds each choice's
    token ids to an `IncrementalDetokenizer` by the engine's own rule (`choice_text`), so the text is
    the same.
    `context` is the sequence's tokens before generation (`context_ids`), shared by all choices.
    """

    def __init__(self, tokenizer, context: abc.Sequence[int]):
        self.tokenizer = tokenizer
        self.context = list(context)
        self._choices: dict[int, IncrementalDetokenizer] = {}

    def apply(self, out: RequestOutput) -> RequestOutput:
        for choice in out.outputs:
            detok = self._choices.get(choice.index)
            if detok is None:
                detok = self._choices[choice.index] = IncrementalDetokenizer(self.tokenizer, self.context)
            choice.text = choice_text(detok, choice.token_ids, choice.finish_reason)
        return out

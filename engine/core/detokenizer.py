"""The incremental detokenizer: one sequence's token ids -> text deltas, UTF-8-safe, cut at stop strings.

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
from collections import abc

from engine.api.outputs import RequestOutput

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output token (vLLM's choice)


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas, one `push` per engine step.

    Guarantees:
    - the concatenation of every `push` and the final `flush` equals `tokenizer.decode(output_ids)` (as
      it reads after the prompt, i.e. with the prompt's context for leading spaces), cut at the first
      stop string;
    - no delta ends inside a multibyte character: a trailing U+FFFD from an incomplete byte sequence is
      held back until the following tokens complete it (or `flush` gives it up as it is);
    - the first occurrence of any stop string and everything after it is never returned; `stopped`
      becomes True and `stop_reason` holds the matched string; later pushes are ignored and return "";
    - with `min_tokens`, the text of the first `min_tokens` output tokens is never searched for stop
      strings (it is returned as it comes), so a stop string ends a choice only once it appears in the
      text of later tokens (vLLM's rule; the stop *tokens* are masked that long by the sampler).

    Decoding uses `skip_special_tokens` as given and never applies `clean_up_tokenization_spaces`
    (it would rewrite already-emitted text). The engine should not push EOS / stop-token ids.
    """

    def __init__(self, tokenizer, prompt_ids: abc.Sequence[int] = (), skip_special_tokens: bool = True,
                 stop: abc.Sequence[str] = (), min_tokens: int = 0):
        if isinstance(stop, str):
            stop = [stop]
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty; drop the empty string from `stop`")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.min_tokens = min_tokens
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
        """Add one or more generated token ids; return the newly safe text (possibly ""). Several ids are
        taken one at a time, so a delta of several tokens (speculative decoding) is cut exactly as the
        same tokens arriving one per call: a character completed mid-delta is returned at once."""
        if self._flushed:
            raise RuntimeError("push() after flush(): make a new IncrementalDetokenizer per generation")
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        out = []
        for token in token_ids:
            self._ids.append(token)
            if not self.stopped:
                early = len(self._ids) - self._n_context <= self.min_tokens
                out.append(self._emit(self._decode_delta(final=False), final=False, search=not early))
        return "".join(out)

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

    def _emit(self, delta: str, final: bool, search: bool = True) -> str:
        """Pass decoded text through the stop-string filter (`search`: else it is all safe); return what is
        safe to send."""
        buf = self._pending + delta
        hit = self._find_stop(buf) if search else None
        if hit is not None:
            index, self.stop_reason = hit
            self.stopped = True
            out, self._pending = buf[:index], ""
        else:
            keep = 0 if final or not search else self._partial_stop_len(buf)
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

    def __init__(self, tokenizer, context: abc.Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.context = list(context)
        self.skip_special_tokens = skip_special_tokens
        self._choices: dict[int, IncrementalDetokenizer] = {}

    def apply(self, out: RequestOutput) -> RequestOutput:
        for choice in out.outputs:
            detok = self._choices.get(choice.index)
            if detok is None:
                detok = self._choices[choice.index] = IncrementalDetokenizer(
                    self.tokenizer, self.context, skip_special_tokens=self.skip_special_tokens)
            choice.text = choice_text(detok, choice.token_ids, choice.finish_reason)
        return out

"""Prompt-lookup drafts: what followed the most recent earlier occurrence of a sequence's last n tokens.

`lookup_draft` searches the sequence's own history (prompt and output) first, then other texts (a prediction,
a fork's parent, sibling choices), longest n first. The own history is searched through an `NgramIndex` the
sequence keeps while it drafts: each appended token adds its n-grams once, so a lookup is a few dict probes
rather than a pass over the whole history every tick (a tensor built from a 300-token history and compared
per n cost ~0.1 ms a tick, ~4% of a Q4_1 decode step, growing with the context). Other texts are searched with
one vectorised compare per (n, text).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.spec.costs import MATCH_MAX

NGRAM_MAX = 4  # the longest suffix matched against the history (vLLM's prompt_lookup_max default)
NGRAM_MIN = 1
RECENT = 4  # occurrences looked at, most recent first: the first with a whole draft after it, else the longest


@dataclass
class Lookup:
    """A prompt-lookup draft and how many tokens before its source agree with the history's end (the n-gram
    that found it, extended backwards up to MATCH_MAX): what tells how far it is likely to be kept."""

    tokens: list[int]
    matched: int = 0
    own: bool = True  # found in the sequence's own history (not in a prediction, a parent or a sibling)


@dataclass
class NgramIndex:
    """Where each n-gram (n in [NGRAM_MIN, NGRAM_MAX]) of one token list starts, ascending. It follows the list
    as it grows (`sync`); if the part it indexed changed (a truncation, a rewrite) it starts over, so it is
    never stale."""

    tokens: list[int] = field(default_factory=list)
    starts: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def sync(self, history: list[int]) -> None:
        n = len(self.tokens)
        if len(history) < n or history[:n] != self.tokens:
            self.tokens, self.starts, n = [], {}, 0
        self.tokens.extend(history[n:])
        for end in range(n, len(self.tokens)):
            for size in range(NGRAM_MIN, min(NGRAM_MAX, end + 1) + 1):
                self.starts.setdefault(tuple(self.tokens[end - size + 1 : end + 1]), []).append(end - size + 1)

    def recent(self, size: int) -> list[int]:
        """Starts of the earlier occurrences of the last `size` tokens, at most RECENT, oldest first (the suffix
        itself excluded: an occurrence needs a token after it)."""
        starts = self.starts.get(tuple(self.tokens[len(self.tokens) - size :]), [])
        limit = len(self.tokens) - size - 1  # the latest start with a token after the n-gram
        end = len(starts)
        while end and starts[end - 1] > limit:
            end -= 1
        return starts[max(0, end - RECENT) : end]


def lookup_draft(history: list[int], sources: list[list[int]], k: int, index: NgramIndex | None = None) -> Lookup:
    """Up to k tokens that followed the most recent earlier occurrence of `history`'s last n tokens
    (longest n first, n in [NGRAM_MIN, NGRAM_MAX]), searched in `history` itself (through `index`, synced
    here; a fresh one if None), then in `sources`."""
    if k <= 0 or len(history) < 2:
        return Lookup([])
    if index is None:
        index = NgramIndex()
    index.sync(history)
    own = None  # the history as a tensor: built only if some source is searched
    for n in range(min(NGRAM_MAX, len(history) - 1), NGRAM_MIN - 1, -1):
        found = _best(history, index.recent(n), n, k)
        if found is not None:
            return Lookup(found[1], n + _agreeing(history, found[0], history, len(history) - n, MATCH_MAX - n))
        for text in sources:
            if len(text) <= 1 or len(text) < n:
                continue
            own = torch.as_tensor(history) if own is None else own
            tokens = torch.as_tensor(text)
            hits = (tokens.unfold(0, n, 1) == own[-n:]).all(1).nonzero().flatten().tolist()[-RECENT:]
            found = _best(text, hits, n, k)
            if found is not None:
                return Lookup(found[1], n + _agreeing(text, found[0], history, len(history) - n, MATCH_MAX - n), False)
    return Lookup([])


def _best(tokens: list[int], starts: list[int], n: int, k: int) -> tuple[int, list[int]] | None:
    """Of the n-gram occurrences at `starts` (oldest first), the most recent with k tokens after it, else the
    one with the most: (its start, what follows it); None if nothing follows any."""
    best, at = [], 0
    for start in reversed(starts):
        follow = tokens[start + n : start + n + k]
        if len(follow) > len(best):
            best, at = follow, start
        if len(best) == k:
            break
    return (at, best) if best else None


def _agreeing(a: list[int], a_end: int, b: list[int], b_end: int, most: int) -> int:
    """How many tokens before a[a_end] and before b[b_end] agree, counted backwards, at most `most`."""
    m = min(most, a_end, b_end)
    count = 0
    while count < m and a[a_end - 1 - count] == b[b_end - 1 - count]:
        count += 1
    return count

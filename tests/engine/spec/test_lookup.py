"""Prompt lookup through the n-gram index (engine/spec/lookup.py) against a brute-force scan of the history."""

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.spec.costs import MATCH_MAX
from engine.spec.lookup import NGRAM_MAX, NGRAM_MIN, RECENT, NgramIndex, lookup_draft


def scan(history: list[int], sources: list[list[int]], k: int) -> tuple[list[int], int, bool]:
    """The lookup spelled out: per n (longest first), the own history then each source; of the last RECENT
    occurrences the most recent with k tokens after it, else the one with the most; the match extended
    backwards."""
    if k <= 0 or len(history) < 2:
        return [], 0, True
    for n in range(min(NGRAM_MAX, len(history) - 1), NGRAM_MIN - 1, -1):
        suffix = history[-n:]
        for text, last in [(history, len(history) - n - 1)] + [(s, len(s) - n) for s in sources if len(s) > 1]:
            own = text is history
            hits = [s for s in range(last + 1) if text[s : s + n] == suffix][-RECENT:]
            best, at = [], 0
            for s in reversed(hits):
                if len(text[s + n : s + n + k]) > len(best):
                    best, at = text[s + n : s + n + k], s
                if len(best) == k:
                    break
            if best:
                agree = 0
                while (agree < MATCH_MAX - n and agree < at and agree < len(history) - n
                       and text[at - 1 - agree] == history[len(history) - n - 1 - agree]):
                    agree += 1
                return best, n + agree, own
    return [], 0, True


tokens = st.lists(st.integers(0, 5), max_size=60)


@settings(max_examples=300, deadline=None)
@given(tokens, st.lists(tokens, max_size=2), st.integers(0, 8))
def test_lookup_is_the_scan(history, sources, k):
    found = lookup_draft(history, sources, k)
    assert (found.tokens, found.matched, found.own) == scan(history, sources, k)


@settings(max_examples=100, deadline=None)
@given(tokens, st.lists(st.tuples(st.integers(0, 60), tokens), max_size=6), st.integers(1, 8))
def test_one_index_follows_a_history_that_grows_and_is_cut(history, edits, k):
    """A sequence's index kept across ticks: tokens appended, the history truncated and rewritten (a
    truncate, a rejected draft): every lookup is what a fresh scan gives."""
    index = NgramIndex()
    for cut, more in edits:
        history = history[:cut] + more
        found = lookup_draft(history, [], k, index)
        assert (found.tokens, found.matched, found.own) == scan(history, [], k)
        assert index.tokens == history or len(history) < 2


def test_recent_excludes_the_suffix_itself():
    index = NgramIndex()
    index.sync([1, 2, 1, 2])
    assert index.recent(2) == [0]  # "1 2" at 0; the one at 2 is the suffix
    assert index.recent(1) == [1]  # "2" at 1 (3 is the suffix)

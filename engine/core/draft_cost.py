"""StepCosts: how long a draft pays, from what decode steps of each size cost here and how often drafts are kept.

A verification step's extra rows are not free everywhere: drafted rows run on the kernels that round as the
one-row decode step does (engine/model/native/rows.py), and measured at one thread 9 rows cost ~2x one row in
bf16 on AMX but ~4x on the Q4_1 file's integer row kernel. With each drafted token kept with probability `a`
(until the first miss), a draft of L tokens yields (1 - a^(L+1)) / (1 - a) tokens a step, so the best L is the
one that yields the most tokens per second of the step it makes: on the Q4_1 curve at a = 0.85, 4 tokens
(1.62 tokens per one-row step's time) rather than 8 (1.32).

Costs are learned from the engine's own decode-only steps (an EMA per row count, `observe`); a row count not
seen yet is taken to cost what the nearest one seen does, so a longer draft is tried, and measured, before it
is ruled out. The draft model's own steps (engine/core/draft_model.py) are not counted. Acceptance is per sequence (`Sequence.drafts_kept` / `drafts_missed`, decayed counts).
"""

EMA = 0.2  # weight of the newest observation of a row count's step time
DECAY = 0.8  # per verification: a sequence's recent drafts weigh most
PRIOR_KEPT, PRIOR_MISSED = 4.0, 1.0  # a sequence that has not drafted yet: ~80% of drafted tokens kept


def kept_rate(kept: float, missed: float) -> float:
    """Per-token acceptance: tokens kept over tokens kept plus the misses that ended drafts (geometric MLE)."""
    return kept / (kept + missed) if kept + missed > 0 else 0.0


def expected_tokens(a: float, length: int) -> float:
    """Tokens a step yields with a draft of `length` tokens, each kept with probability `a` until a miss."""
    return float(length + 1) if a >= 1.0 else (1.0 - a ** (length + 1)) / (1.0 - a)


class StepCosts:
    """Seconds a decode-only step takes, per row count (an EMA of what this engine measured)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        prev = self.seconds.get(rows)
        self.seconds[rows] = seconds if prev is None else prev + EMA * (seconds - prev)

    def cost(self, rows: int) -> float | None:
        """The step time of `rows` rows: measured, else interpolated between the row counts around it, else
        the nearest one's (optimistic both ways: past the largest seen, a step costs what that one did; below
        the smallest, what that one did); None while nothing was measured."""
        if rows in self.seconds:
            return self.seconds[rows]
        below = max((r for r in self.seconds if r < rows), default=None)
        above = min((r for r in self.seconds if r > rows), default=None)
        if below is None or above is None:
            nearest = above if below is None else below
            return None if nearest is None else self.seconds[nearest]
        t0, t1 = self.seconds[below], self.seconds[above]
        return t0 + (t1 - t0) * (rows - below) / (above - below)

    def best_length(self, base_rows: int, a: float, longest: int) -> int:
        """The draft length in [1, longest] that yields the most tokens per second for a sequence whose step
        already has `base_rows` rows (one per decoding sequence); `longest` while nothing was measured."""
        if longest <= 1 or not self.seconds:
            return longest
        best, best_rate = longest, 0.0
        for length in range(1, longest + 1):
            rate = expected_tokens(a, length) / self.cost(base_rows + length)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = length, rate
        return best

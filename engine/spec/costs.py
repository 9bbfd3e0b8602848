"""How long a draft pays: from what decode steps of each size cost here and how often drafts are kept.

A verification step's extra rows are not free everywhere: drafted rows run on the kernels that round as the
one-row decode step does (engine/model/native/rows.py), and on the Q4_1 file a 9-row step costs ~2.4x one
row. A draft of L tokens yields 1 + S(1) + ... + S(L) tokens a step, S(j) being the chance that its first j
tokens are kept, so the best L (none included) is the one that yields the most tokens per second of the step
it makes. Where S comes from:
- a prompt-lookup draft (`MatchAcceptance`): from how long the match behind it is. The tokens just before the
  place a draft is copied from agree with the sequence's last tokens over some length: measured on the copy
  workloads, a 1-token match keeps ~0.7 tokens of 8, a 16-token one ~7.3. Engine-wide counts per match
  length and draft position learn S (from `PRIOR_FIRST` / `PRIOR_LATER`, measured there); a guess that seldom
  pays (a short match) is then not drafted at all;
- a followed text (a prediction, a fork's parent) or a draft model: per sequence, each drafted token kept
  with probability `a` (decayed counts, `DraftState.kept` / `missed`) until a miss: S(j) = a^j.

Costs are learned from the engine's own decode-only steps (an EMA per row count, `observe`); a row count not
seen yet is taken to cost what the nearest one seen does, so a longer draft is tried, and measured, before it
is ruled out; until the undrafted tick's row count is timed, "auto" runs it without drafts (below the fewest rows
timed a step would look as dear as those, and any draft free). The draft model's own steps
(engine/spec/draft_model.py) are not counted here: it times them itself, and each token it drafts costs one
(`best_length`'s `per_token`).
"""

EMA = 0.2  # weight of the newest observation of a row count's step time
DECAY = 0.8  # per verification: a sequence's recent drafts weigh most
PRIOR_KEPT, PRIOR_MISSED = 4.0, 1.0  # a sequence that has not drafted yet: ~80% of drafted tokens kept


def ema(prev: float | None, seconds: float) -> float:
    """A step time's running estimate: the first observation, then each newest one weighing EMA."""
    return seconds if prev is None else prev + EMA * (seconds - prev)


def kept_rate(kept: float, missed: float) -> float:
    """Per-token acceptance: tokens kept over tokens kept plus the misses that ended drafts (geometric MLE)."""
    return kept / (kept + missed) if kept + missed > 0 else 0.0


def geometric(a: float, longest: int) -> list[float]:
    """S(1..longest) for drafted tokens each kept with probability `a` until the first miss."""
    return [a ** j for j in range(1, longest + 1)]


class StepCosts:
    """Seconds a decode-only step takes, per row count (an EMA of what this engine measured)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        self.seconds[rows] = ema(self.seconds.get(rows), seconds)

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

    def rate(self, base_rows: int, kept: list[float], length: int, per_token: float = 0.0) -> float:
        """Expected tokens per second of a draft of `length` (see `best_length`; something must be timed)."""
        return (1.0 + sum(kept[:length])) / (self.cost(base_rows + length) + per_token * length)

    def timed(self, rows: int) -> bool:
        """Whether a step of `rows` rows was timed. Below the fewest rows timed a step is taken to cost what
        that one did, which would make any draft look free: "auto" times the undrafted tick first."""
        return rows in self.seconds

    def best_length(self, base_rows: int, kept: list[float], longest: int, shortest: int = 1,
                    per_token: float = 0.0) -> int:
        """The draft length in [shortest, longest] that yields the most tokens per second for a sequence whose
        step already has `base_rows` rows (one per decoding sequence), `kept[j - 1]` being the chance that a
        draft's first j tokens are kept and `per_token` the seconds each drafted token takes to make (a draft
        model's forward); `longest` while nothing was measured."""
        if longest <= shortest or not self.seconds:
            return longest
        best, best_rate = shortest, 0.0
        for length in range(shortest, longest + 1):
            rate = self.rate(base_rows, kept, length, per_token)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = length, rate
        return best


MATCH_MAX = 16  # matches are measured up to this many tokens
MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)  # lower bounds of the match lengths counted together
# Before a bucket has seen drafts, per bucket: the chance a draft's first token is kept, and each later one given
# the ones before it were, as measured on SmolLM2-135M-Instruct's copy workloads (edit, quote, summarise: every
# position's lookup draft against 36 greedy answers): a 1-token match's first token was kept 31% of the time, a
# 16-token one's 98%. A flat 70% drafted whole short-match drafts on a fresh server's first requests (a
# paraphrasing answer: 45 tokens drafted, 2 kept, slower than no drafts).
PRIOR_FIRST = (0.30, 0.60, 0.70, 0.70, 0.80, 0.90, 0.95, 0.98)
PRIOR_LATER = (0.70, 0.75, 0.85, 0.85, 0.90, 0.93, 0.95, 0.98)
PRIOR_TRIED = 2.0  # the prior weighs as much as two drafts
HALVE_AT = 1000.0  # a bucket's counts halve past this many drafts: recent drafts weigh most


# A lookup draft from the sequence's own history behind a match shorter than this is also judged by how its
# earlier such drafts fared: an answer that paraphrases its prompt keeps almost none of them while the
# engine-wide rates, learned mostly from answers that copy, expect a third to two thirds kept (a `summarise`
# answer drafted 5 tokens behind each 2-token match ten times, keeping 2: slower than no drafts). Longer
# matches are left to the engine-wide rates: there one miss (a renamed identifier in a copied file) says little
# about the next draft; so are drafts found in a prediction, a parent or a sibling (what they are there for).
SHORT_MATCH = 4
SEQ_PRIOR = 1.0  # the engine-wide rate counts as this many of the sequence's own drafts
SEQ_DECAY = 0.9  # per short-match draft: the sequence's recent drafts weigh most


def calibrated(kept: list[float], expected: float, hits: float) -> list[float]:
    """S(1..) of a short-match lookup draft scaled by the sequence's own record: its short-match drafts kept
    `hits` tokens where the engine-wide rates expected `expected` kept (decayed sums)."""
    scale = (hits + SEQ_PRIOR) / (expected + SEQ_PRIOR)
    return [min(1.0, s * scale) for s in kept]


class MatchAcceptance:
    """Per match length and draft position: how often a prompt-lookup draft's j-th token was kept, given that
    the ones before it were (each verification counts the positions it tried: up to the first miss)."""

    def __init__(self, longest: int) -> None:
        self.tried = [[PRIOR_TRIED] * longest for _ in MATCH_BUCKETS]
        self.kept = [[PRIOR_TRIED * (first if j == 0 else later) for j in range(longest)]
                     for first, later in zip(PRIOR_FIRST, PRIOR_LATER, strict=True)]

    @staticmethod
    def bucket(matched: int) -> int:
        return max(i for i, low in enumerate(MATCH_BUCKETS) if matched >= low or i == 0)

    def survival(self, matched: int, longest: int) -> list[float]:
        """S(1..longest): the chance that a draft behind a match of `matched` tokens keeps its first j tokens."""
        b, out, s = self.bucket(matched), [], 1.0
        for j in range(longest):
            s *= self.kept[b][j] / self.tried[b][j]
            out.append(s)
        return out

    def observe(self, matched: int, drafted: int, kept: int) -> None:
        b = self.bucket(matched)
        tried, hits = self.tried[b], self.kept[b]
        if tried[0] > HALVE_AT:
            self.tried[b], self.kept[b] = [t / 2 for t in tried], [k / 2 for k in hits]
            tried, hits = self.tried[b], self.kept[b]
        for j in range(min(drafted, kept + 1)):
            tried[j] += 1.0
            hits[j] += 1.0 if j < kept else 0.0

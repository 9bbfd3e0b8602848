"""DraftState: what the speculative decoder knows of one sequence, kept by the decoder (never on the sequence).

This tick's draft (its tokens, a draft model's q rows, the match that found a lookup draft) and how the
sequence's past drafts fared (the adaptive length, the draft model's back-off, decayed counts of tokens
kept and missed): `SpeculativeDecoder` writes them, `DraftModel` fills a draft's tokens and q rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.spec.costs import PRIOR_KEPT, PRIOR_MISSED

if TYPE_CHECKING:
    import torch


@dataclass(eq=False)
class DraftState:
    tokens: list[int] = field(default_factory=list)  # this tick's guessed next tokens, not yet truth
    q: torch.Tensor | None = None  # a draft model's sampled draft: the distribution of each token (rows)
    match: int = 0  # a prompt-lookup draft's match length (0: the draft came from elsewhere)
    expect: float | None = None  # this tick's own short-match lookup draft: the tokens of it the engine-wide
    # rates expect kept (None: a draft the sequence's record does not judge)
    length: int = 0  # how many tokens its next draft may hold (0: the engine's maximum); adapts to acceptance
    pause: int = 0  # ticks to go without the draft model ("auto" backs off after its drafts wholly missed)
    misses: int = 0  # wholly rejected model drafts in a row
    kept: float = PRIOR_KEPT  # decayed counts of drafted tokens kept and of misses that ended drafts
    missed: float = PRIOR_MISSED  # (engine/spec/costs.py: what draft length pays)
    short_expected: float = 0.0  # its lookup drafts behind short matches: drafted tokens the engine-wide rates
    short_hits: float = 0.0  # expected kept, and tokens kept (decayed sums; costs.calibrated)

    def clear(self) -> None:
        """No draft this tick (the record of past drafts stays)."""
        self.tokens, self.q, self.match = [], None, 0

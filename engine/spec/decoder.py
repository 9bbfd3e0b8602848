"""Speculative decoding over cells: model-free drafts, verified in the normal step, rejected with seq_rm.

At one sequence a CPU decode step streams every weight once per token, so the only way past the memory
bandwidth floor is more tokens per weight pass. A decoding sequence may carry a *draft*: up to k tokens
guessed without a model. First a text the sequence follows token for token, whose next tokens are
the draft: the request's predicted output (OpenAI's `prediction`, while the output so far equals its
start) or, for a forked persistent sequence, its parent's tokens past the fork point (a regenerate or an
edit forks where the parent's old reply began: while the new reply repeats the old one, it is drafted
whole). Failing that, prompt lookup: the continuation of the most recent earlier occurrence of its last n
tokens in its own history, then in those texts and its siblings' (the other choices of an `n > 1`
request, which share its prompt and often its phrasing). The draft rides the ordinary flat step
as a short chunk after the sequence's last token, on the sequence's own cells, and every drafted
position's logits come back. `verify` then takes the longest prefix of the draft that the sequence would
have produced anyway plus the token its first mismatch (or the draft's end) yields; the engine's update
appends them and the scheduler drops the cells of the rejected positions with `seq_rm` (`settle_draft`).

Guarantees:
- output is token for token the output without speculation, greedy or seeded, wherever the model's
  logits for a token do not depend on how many rows share its step: up to INVARIANT_ROWS rows on the
  native forward's kernels in bf16 on AMX and on quantized weights (engine/model/native/rows.py says
  where; in float32 the one-row and many-row linears differ in the last bits, ~1e-7 of a logit, and
  outputs matched in every run measured): row i is sampled with
  exactly the history (outputs + accepted draft tokens) it would have had, penalties included, and with
  the random draws the i-th next token would have used (the row's generator is rewound after the
  verification and replayed over the kept rows only); a draft token is kept only if it equals the token
  its row yields. For a draft proposed without a model this is exactly speculative sampling: a token
  equal to the draft is accepted with probability p(draft), and on a mismatch the row's token is drawn
  from p without the draft token (the residual distribution);
- with a draft model (engine/spec/draft_model.py, where no model-free draft exists, or under "auto" where it
  promises more tokens a second than the lookup draft, its own cost a token counted): a greedy row's draft
  is checked as above (output unchanged); a sampled row's draft was drawn from the draft model's q and is
  accepted by standard speculative sampling (`_accept_drawn`): the output follows the target's
  distribution exactly, and is reproducible for a seed, but is not the draw the seed gives without drafts;
- rows with a grammar do not draft (the grammar's state would have to follow tokens that may be
  rejected); they decode one token as before;
- after a tick's update a sequence's cells hold exactly positions `[0, n_cached)` of its token ids, whether it
  keeps running, finished on an accepted token (EOS, a stop string, max_tokens) or went idle.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.api.outputs import TokenLogprob
from engine.core.plan import Chunk, Queues
from engine.core.sequence import Choice, Sequence
from engine.sample.sampler import Sampler, advance
from engine.spec.costs import (
    DECAY,
    SEQ_DECAY,
    SHORT_MATCH,
    MatchAcceptance,
    StepCosts,
    calibrated,
    geometric,
    kept_rate,
)
from engine.spec.lookup import NgramIndex, lookup_draft
from engine.spec.state import DraftState

log = logging.getLogger("cellserve.speculative")

# "auto" drafts only while at most this many sequences decode: there one step streams every weight once
# for few rows, so drafted rows ride almost free; with more, a step is compute-bound and drafts cost.
AUTO_MAX_DECODING = 4
# "auto" drafts no longer than pays on this machine's measured step costs (engine/spec/costs.py): a
# prompt-lookup draft by how long its match is, none where that seldom pays. A draft model's drafts cost a
# draft forward each, so "auto" also backs off a sequence whose model drafts keep missing: after each wholly
# rejected one it decodes without the draft model for 2, 4, 8 ... up to this many ticks.
AUTO_MAX_PAUSE = 64


@dataclass
class Verified:
    """A drafted chunk's verification: the tokens it yields, in order (kept draft tokens, then one more), their
    logprobs (None where not asked), and whether the draft was the draft model's."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    by_model: bool


class SpeculativeDecoder:
    """Proposes drafts for the running sequences before a tick and verifies them after its forward."""

    def __init__(self, queues: Callable[[], Queues], sampler: Sampler, k: int,
                 max_model_len: int, *, always: bool = True,
                 persistent: Callable[[str], Sequence | None] = lambda seq_id: None, drafter=None):
        """`queues`: the scheduler's public read of who runs and how many wait (`Scheduler.queues`), asked once a
        tick by `propose`. `persistent`: a persistent sequence by id (a fork's parent is a draft source), None if gone.
        `drafter`: a `DraftModel` (engine/spec/draft_model.py) drafting where no model-free draft exists (or,
        under "auto", where it pays more than the lookup: `_model_pays_more`)."""
        self.queues, self.sampler = queues, sampler
        self.n_running = 0  # sequences decoding this tick (`propose` reads it off `queues`)
        self.persistent, self.drafter = persistent, drafter
        self.k, self.max_model_len, self.always = k, max_model_len, always
        self.drafted = self.accepted = 0  # tokens proposed / kept, for reports
        self.costs = StepCosts()  # decode-only step times per row count (the engine reports them)
        self.matches = MatchAcceptance(k)  # prompt-lookup drafts kept, by match length and position
        self.indexes: dict[str, NgramIndex] = {}  # the running sequences' own histories, indexed (lookup.py)
        # every sequence's draft state, for as long as the sequence lives (its record outlasts a request)
        self.states: weakref.WeakKeyDictionary[Sequence, DraftState] = weakref.WeakKeyDictionary()

    def state(self, seq: Sequence) -> DraftState:
        """`seq`'s draft state (a fresh one for a sequence that never drafted)."""
        state = self.states.get(seq)
        if state is None:
            state = self.states[seq] = DraftState()
        return state

    def propose(self) -> dict[Sequence, list[int]]:
        """A draft for every eligible running sequence (the scheduler may still cut it for room); with
        `always` off, only while few sequences decode and nothing prefills (`_quiet`)."""
        queues = self.queues()
        running, self.n_running = queues.running, len(queues.running)
        # "auto" prices a draft against the same tick without one: until a tick of that many rows was timed
        # (a fresh engine; every tick drafted since), it runs one without drafts, which times it
        quiet = self.always or (self._quiet(running, queues.n_waiting) and self.costs.timed(len(running)))
        by_model = []  # (sequence, its state, room): no free draft, the draft model's then
        self.indexes = {seq.seq_id: self.indexes[seq.seq_id] for seq in running if seq.seq_id in self.indexes}
        for seq in running:
            state = self.state(seq)
            state.clear()
            room = self._room(seq) if quiet and self._eligible(seq) else 0
            state.tokens = self._draft_for(seq, room) if room > 0 else []
            if state.pause > 0 and not self.always:
                state.pause -= 1
            elif room > 0 and self.drafter is not None and (not state.tokens or self._model_pays_more(seq, room)):
                state.tokens, state.match = [], 0
                by_model.append((seq, state, self._paced(seq, room, self.drafter.token_seconds)))
        if by_model:
            self._model_drafts(by_model)
        return {seq: self.states[seq].tokens for seq in running if self.states[seq].tokens}

    def _model_pays_more(self, seq: Sequence, room: int) -> bool:
        """Under "auto", whether the draft model is expected to yield more tokens per second than the sequence's
        lookup draft this tick (a short match in an answer that paraphrases: the model's drafts are kept far
        more often, at a draft forward a token). A followed text's draft is never replaced. (A lookup draft
        exists only once this tick's undrafted row count was timed: `propose`.)"""
        state = self.state(seq)
        if not state.match:
            return False
        base, ts = self.n_running, self.drafter.token_seconds
        lookup = self.costs.rate(base, self.matches.survival(state.match, len(state.tokens)), len(state.tokens))
        length = self._paced(seq, room, ts)
        model = self.costs.rate(base, geometric(kept_rate(state.kept, state.missed), length), length, ts)
        return model > lookup

    def _quiet(self, running: list[Sequence], n_waiting: int) -> bool:
        """"auto" drafts only in a tick that is all decodes of few sequences: there the step streams every
        weight once for a few rows and drafted rows ride almost free. A prompt being prefilled (or waiting
        to be) makes the tick compute-bound, so drafts there would cost time and delay its first token."""
        return (len(running) <= AUTO_MAX_DECODING and not n_waiting
                and all(s.cache_target() - s.n_cached <= 1 for s in running))

    def _model_drafts(self, wanted: list[tuple[Sequence, DraftState, int]]) -> None:
        try:
            self.drafter.propose(wanted)
        except Exception:  # a failing draft costs its drafts, never the target's step
            log.exception("the draft model failed; this tick runs without its drafts")
            for _, state, _ in wanted:
                state.tokens, state.q = [], None

    def _eligible(self, seq: Sequence) -> bool:
        req = seq.request
        return (req is not None and not req.prefill_only and seq.choice.grammar is None
                and seq.cache_target() - seq.n_cached == 1 and not req.children_pending)

    def _room(self, seq: Sequence) -> int:
        """How many tokens the sequence may draft this tick at most: k, within max_tokens and the context."""
        choice = seq.choice
        return min(self.k, choice.params.max_tokens - choice.num_generated - 1,
                   self.max_model_len - len(seq.token_ids) - 1)

    def _paced(self, seq: Sequence, room: int, token_seconds: float = 0.0) -> int:
        """A followed text's or the draft model's length: the sequence's adaptive length within `room`; under
        "auto" also no longer than pays for its acceptance on this machine's step costs (costs.py), each
        drafted token costing `token_seconds` more to make (the draft model's forward; a followed text's is free)."""
        state = self.state(seq)
        room = min(state.length or self.k, room)
        if self.always or room <= 1:
            return room
        a = kept_rate(state.kept, state.missed)
        return self.costs.best_length(self.n_running, geometric(a, room), room, per_token=token_seconds)

    def _draft_for(self, seq: Sequence, room: int) -> list[int]:
        followed = self._followed(seq)
        for text, start in followed:
            n = len(seq.token_ids)
            ahead = text[n - start : n - start + room] if n - start >= 0 else []
            if ahead and text[: n - start] == seq.token_ids[start:]:  # following it so far: its next tokens
                return ahead[: self._paced(seq, len(ahead))]
        sources = [text for text, _ in followed] + [s.token_ids for s in seq.request.seqs if s is not seq]
        index = self.indexes.setdefault(seq.seq_id, NgramIndex())
        if self.always:  # "ngram": as long as the sequence's own adaptive length allows
            return lookup_draft(seq.token_ids, sources, self._paced(seq, room), index).tokens
        found = lookup_draft(seq.token_ids, sources, room, index)
        if not found.tokens:
            return []
        rates = self.matches.survival(found.matched, len(found.tokens))
        own_short = found.own and found.matched < SHORT_MATCH  # judged by the sequence's record too
        state = self.state(seq)
        kept = calibrated(rates, state.short_expected, state.short_hits) if own_short else rates
        draft = found.tokens[: self.costs.best_length(self.n_running, kept, len(found.tokens), shortest=0)]
        state.match = found.matched if draft else 0  # what verify counts this draft's outcome under
        state.expect = sum(rates[: len(draft)]) if own_short else None
        return draft

    def _followed(self, seq: Sequence) -> list[tuple[list[int], int]]:
        """Texts the sequence may follow token for token, each with the position of seq.token_ids where
        it starts: the request's prediction (at the output's start), a fork's parent (past the fork) when it runs
        under the same LoRA adapter (another adapter's text predicts this one's poorly)."""
        choice = seq.choice
        texts = [(choice.params.prediction_ids, choice.gen_start)] if choice.params.prediction_ids else []
        parent = self.persistent(seq.parent) if seq.parent is not None and seq.fork_at is not None else None
        if parent is not None and len(parent.token_ids) > seq.fork_at and _adapter(parent) == _adapter(seq):
            texts.append((parent.token_ids[seq.fork_at :], seq.fork_at))
        return texts

    def verify(self, chunk: Chunk, rows: torch.Tensor) -> Verified:
        """What a drafted chunk's rows (1 + len(draft), in order) yield: the longest prefix of the draft that
        the sequence would have produced anyway plus the token its first mismatch (or the draft's end) gives.
        Only the choice's generator moves (as if only the kept rows had been sampled); the caller appends the
        tokens, then reports with `record` how many it kept."""
        choice, state = chunk.seq.choice, self.state(chunk.seq)
        q = state.q[: len(chunk.draft)] if state.q is not None else None
        if q is None:
            tokens, lps = self._accept(choice, chunk.draft, rows)
        else:
            tokens, lps = self._accept_drawn(choice, chunk.draft, rows, q)
        by_model = self.drafter is not None and self.drafter.drafted_for(chunk.seq, state.tokens)
        return Verified(tokens, lps, by_model)

    def record(self, chunk: Chunk, verified: Verified, kept: int) -> int:
        """`kept` of the verified tokens were appended (a finish may stop short): count the draft's outcome, let
        the next drafts learn from it (`_adapt`), and forget this tick's draft. Returns the drafted tokens kept
        (the last appended token is not a draft's: it has no cell)."""
        state = self.state(chunk.seq)
        drafts_kept = min(kept, len(verified.tokens) - 1)
        self.drafted += len(chunk.draft)
        self.accepted += drafts_kept
        if verified.by_model:
            self.drafter.count(len(chunk.draft), drafts_kept)
        self._adapt(state, len(chunk.draft), drafts_kept, verified.by_model)
        state.tokens, state.q = [], None
        return drafts_kept

    def _adapt(self, state: DraftState, drafted: int, kept: int, by_model: bool) -> None:
        """What the next drafts learn from this one: a lookup draft's outcome counts for its match length; a
        followed text's or model's adapts the sequence's own length (a draft kept whole may double next time: a
        copy runs for long, reach k in a few ticks; else it shrinks to what was kept, plus one) and rate, and
        model drafts wholly rejected pause the draft model for the sequence."""
        if state.match:
            self.matches.observe(state.match, drafted, kept)
            if state.expect is not None:
                state.short_expected = SEQ_DECAY * state.short_expected + state.expect
                state.short_hits = SEQ_DECAY * state.short_hits + kept
            return
        state.length = min(self.k, max(2 * drafted, state.length or self.k)) if kept == drafted else kept + 1
        state.kept = DECAY * state.kept + kept
        state.missed = DECAY * state.missed + (kept < drafted)
        if by_model:
            state.misses = 0 if kept else state.misses + 1
            state.pause = min(AUTO_MAX_PAUSE, 2 ** state.misses) if state.misses else 0

    def settle(self) -> None:
        """After a tick: the draft model's pool keeps no cell of a drafted token the target did not keep."""
        if self.drafter is not None:
            self.drafter.sync_all()

    def _accept(self, choice: Choice, draft: list[int], rows: torch.Tensor) -> tuple[list[int], list]:
        """The tokens row by row would yield (row i sees the outputs plus draft[:i]), cut after the first
        row whose token differs from the draft's."""
        n = len(draft) + 1
        p = choice.params
        outs = [choice.output_ids + draft[:i] for i in range(n)] if p.has_penalties else [[]] * n
        prompt = [choice.history if p.has_penalties else []] * n
        g = choice.generator
        state = g.get_state() if g is not None else None
        result = self.sampler(rows, [p] * n, [g] * n, outs, prompt, [None] * n)
        a = 0
        while a < len(draft) and result.token_ids[a] == draft[a]:
            a += 1
        if g is not None:  # as if only the kept rows had been sampled, one per tick
            g.set_state(state)
            advance(g, a + 1, rows.shape[1])
        lps = [TokenLogprob(t, lp, top or []) if lp is not None else None
               for t, lp, top in zip(result.token_ids, result.logprobs, result.top_logprobs)]
        return result.token_ids[: a + 1], lps[: a + 1]

    def _accept_drawn(self, choice: Choice, draft: list[int], rows: torch.Tensor, q: torch.Tensor
                      ) -> tuple[list[int], list]:
        """Speculative sampling for a draft drawn from q (a draft model's, on a sampled row): draft[i] is kept
        with probability min(1, p_i(draft[i]) / q_i(draft[i])), p_i being the distribution row i samples from
        (`Sampler.distribution`: its history is the outputs plus draft[:i]); the first one refused is replaced
        by a draw from max(0, p_i - q_i), normalised, and a draft kept whole earns a draw from p at its end.
        The tokens then follow p exactly (Leviathan et al., 2023). With a one-hot q (a model-free draft) it is
        `_accept`'s rule. Every draw comes from the sequence's generator: a seeded request is reproducible."""
        n, par = len(draft) + 1, choice.params
        outs = [choice.output_ids + draft[:i] for i in range(n)] if par.has_penalties else None
        prompt = [choice.history] * n if par.has_penalties else None
        p = self.sampler.distribution(rows, [par] * n, outs, prompt)
        at, d = torch.arange(len(draft)), torch.tensor(draft)
        u = torch.rand(len(draft), generator=choice.generator, dtype=torch.float64)
        refused = (u * q[at, d].double() >= p[at, d].double()).nonzero().flatten()
        a = int(refused[0]) if refused.numel() else len(draft)
        last = (p[a] - q[a]).clamp(min=0) if a < len(draft) else p[a]
        last = last if last.sum() > 0 else p[a]  # p <= q everywhere only where p == q: p itself then
        tokens = draft[:a] + [int(torch.multinomial(last, 1, generator=choice.generator))]
        if par.logprobs is None:
            return tokens, [None] * len(tokens)
        lp, top = self.sampler.logprobs(rows[: len(tokens)], torch.tensor(tokens), [par] * len(tokens))
        return tokens, [TokenLogprob(t, v, k or []) for t, v, k in zip(tokens, lp, top)]


def _adapter(seq: Sequence) -> str | None:
    """The name of the LoRA adapter `seq` runs under (None: the base)."""
    return seq.lora.name if seq.lora is not None else None

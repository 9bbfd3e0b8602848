"""A draft model for speculative decoding (`--draft-model`): a smaller model of the target's vocabulary
proposes each sequence's next k tokens; the target verifies them in its normal step (engine/spec/decoder.py).

The draft runs on its own `ModelRunner` with its own cell pool, addressed by the target's slot ids: the
scheduler stays the one owner of sequences and their cells, and tells this pool what happened to them
(`released`, `cut`, `shared`: a fork shares the draft's cells too, a cancel or an eviction drops them).
What the draft lacks (a prompt the target prefilled, accepted tokens, cells loaded from disk) it catches up
in its first step of a tick. One tick drafts every eligible sequence at once: k flat steps over all of
them (the first carries each one's catch-up tokens and its last token, the others one drafted token each).

Guarantees:
- between ticks (outside `propose` .. `sync`) the draft pool holds, for every slot, exactly positions
  `[0, held[slot])` of the sequence in that slot, with `held[slot]` <= its target `n_cached`: cells of
  drafted tokens the target did not keep are dropped with the draft's own `seq_rm`;
- a greedy row's draft is the draft model's argmax; a sampled row's tokens are drawn, with the sequence's
  own generator, from the draft's distribution q under the request's sampling parameters, and q's rows
  ride along (`DraftState.q`) so that verification can accept with min(1, p/q);
- when the draft pool is short of cells, idle slots' draft cells go first, then sequences skip drafting
  (a draft is a guess: it never takes anything from the target).
"""

from __future__ import annotations

import time

import torch

from engine.api.errors import ModelSourceError
from engine.core.sequence import Sequence
from engine.model.flat_step import flatten_step
from engine.model.runner import ModelRunner
from engine.sample.sampler import Sampler
from engine.spec.costs import ema
from engine.spec.state import DraftState


def check_same_vocabulary(target: ModelRunner, draft: ModelRunner, name: str) -> None:
    """Refuse a draft whose token ids mean other text than the target's (its drafts would never match)."""
    sizes = [r.config.get_text_config().vocab_size for r in (target, draft)]
    if sizes[0] != sizes[1]:
        raise ModelSourceError(f"draft model {name} has a vocabulary of {sizes[1]} tokens and the target "
                               f"{sizes[0]}: a draft model must use the target's tokenizer (the same model "
                               f"family, e.g. a smaller size or a quantized copy)")
    tokenizers = (target.tokenizer, draft.tokenizer)
    if None not in tokenizers and tokenizers[0].get_vocab() != tokenizers[1].get_vocab():
        raise ModelSourceError(f"draft model {name} has another tokenizer than the target (same size, "
                               f"different tokens): a draft model must use the target's tokenizer")


class DraftModel:
    """The draft model's runner and its pool's bookkeeping; `propose` drafts, `sync` trims after verification."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, max_step_tokens: int):
        self.runner, self.cache, self.sampler = runner, runner.cache, sampler
        self.max_step_tokens = max_step_tokens  # catch-up tokens one tick may prefill
        self.held = [0] * self.cache.max_seqs  # slot -> the draft holds positions [0, held)
        self.fed: dict[int, tuple[Sequence, int, list[int]]] = {}  # slot -> (seq, start, its draft this tick)
        self.drafted = self.accepted = 0  # this model's tokens proposed / kept (a part of SpeculativeDecoder's)
        self.token_seconds = 0.0  # what one drafting step takes (an EMA, catch-up steps not counted; 0 until timed)

    # ----- the scheduler's mirror: the target's cells changed ----------------------------------
    def released(self, slot: int) -> None:
        if self.held[slot]:
            self.cache.seq_rm(slot)
        self.held[slot] = 0
        self.fed.pop(slot, None)

    def cut(self, slot: int, n: int) -> None:
        if self.held[slot] > n:
            self.cache.seq_rm(slot, n)
            self.held[slot] = n

    def shared(self, src: int, dst: int, upto: int) -> None:
        """`dst` took `src`'s cells up to `upto`; the two sequences have the same tokens there (every caller of
        `Scheduler.share` shares a common prefix), so dst takes src's draft cells of what it lacks too."""
        lo, hi = self.held[dst], min(upto, self.held[src])
        if hi > lo:
            self.cache.seq_cp(src, dst, upto=hi, start=lo)
            self.held[dst] = hi

    # ----- one tick ----------------------------------------------------------------------------
    def propose(self, wanted: list[tuple[Sequence, DraftState, int]]) -> None:
        """Draft up to `room` tokens for each (running, decoding, draft-less) sequence of `wanted` into its
        state's `tokens` (and, for a sampled one, q's rows into its `q`). Step 0 carries each sequence's
        catch-up tokens through its last one; step i > 0 feeds draft token i - 1 of those still drafting."""
        self.sync_all()
        states = {seq: state for seq, state, _ in wanted}
        plan = self._plan([(seq, room) for seq, _, room in wanted])
        if not plan:
            return
        rooms = {seq: room for seq, _, room in plan}
        chunks = {seq.slot: (seq.token_ids[self.held[seq.slot] : self.held[seq.slot] + n], self.held[seq.slot])
                  for seq, n, _ in plan}
        for seq, _, _ in plan:
            self.fed[seq.slot] = (seq, len(seq.token_ids), states[seq].tokens)
        rows, step = [seq for seq, _, _ in plan], 0
        while chunks:
            started = time.perf_counter()
            logits = self.runner.forward(flatten_step(chunks))
            if step > 0:  # one drafted token per sequence: what a longer draft costs per token
                self.token_seconds = ema(self.token_seconds or None, time.perf_counter() - started)
            for seq in rows:
                tokens, start = chunks[seq.slot]
                self.held[seq.slot] = start + len(tokens)
            drafting = [(j, seq) for j, seq in enumerate(rows) if rooms[seq] > step]
            if drafting:
                self._choose([(seq, states[seq]) for _, seq in drafting], logits[[j for j, _ in drafting]])
            step += 1
            rows = [seq for _, seq in drafting if rooms[seq] > step]
            chunks = {seq.slot: (states[seq].tokens[-1:], len(seq.token_ids) + step - 1) for seq in rows}

    def _plan(self, wanted: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int, int]]:
        """(sequence, catch-up tokens, draft length) for this tick, within the catch-up budget (a sequence
        whose catch-up is cut drafts nothing this tick) and the draft pool's free cells."""
        plan, budget = [], self.max_step_tokens
        for seq, room in wanted:
            n = len(seq.token_ids) - self.held[seq.slot] if seq.slot is not None else 0
            room = min(room, self.runner.max_model_len - len(seq.token_ids))
            if n <= 0 or budget <= 0 or room <= 0:
                continue
            plan.append((seq, min(n, budget), room if n <= budget else 0))
            budget -= n
        need = sum(n + max(room - 1, 0) for _, n, room in plan)
        self._make_room(need, {seq.slot for seq, _, _ in plan})
        while plan and not self.cache.can_extend(need):
            _, n, room = plan.pop()
            need -= n + max(room - 1, 0)
        return plan

    def _make_room(self, need: int, keep: set[int]) -> None:
        """Drop the draft cells of slots not drafting now (idle sequences, cached prefixes), most first."""
        for slot in sorted((s for s, n in enumerate(self.held) if n and s not in keep), key=lambda s: -self.held[s]):
            if self.cache.can_extend(need):
                return
            self.released(slot)

    def _choose(self, drafting: list[tuple[Sequence, DraftState]], logits: torch.Tensor | None) -> None:
        """Append each sequence's next draft token: the argmax for greedy rows, a draw from q for sampled ones."""
        if not drafting:
            return
        choices = [seq.choice for seq, _ in drafting]
        params = [c.params for c in choices]
        pen = [p.has_penalties for p in params]
        outs = [c.output_ids + st.tokens if p else [] for c, (_, st), p in zip(choices, drafting, pen)]
        prompts = [c.history if p else [] for c, p in zip(choices, pen)]
        q = self.sampler.distribution(logits, params, outs, prompts)
        for k, (choice, (_, state)) in enumerate(zip(choices, drafting)):
            if choice.params.greedy:
                state.tokens.append(int(q[k].argmax()))
                continue
            state.tokens.append(int(torch.multinomial(q[k], 1, generator=choice.generator)))
            row = q[k : k + 1]
            state.q = row if state.q is None else torch.cat([state.q, row])

    def drafted_for(self, seq: Sequence, draft: list[int]) -> bool:
        """Whether `draft`, `seq`'s draft this tick, is this model's (for the counters)."""
        entry = self.fed.get(seq.slot) if seq.slot is not None else None
        return entry is not None and entry[0] is seq and entry[2] is draft and bool(draft)

    # ----- after verification --------------------------------------------------------------------
    def count(self, drafted: int, accepted: int) -> None:
        """One of its drafts was verified: `drafted` tokens, `accepted` of them kept."""
        self.drafted += drafted
        self.accepted += accepted

    def sync(self, seq: Sequence) -> None:
        """Keep only the drafted positions whose token the sequence now has, never past its target cells."""
        slot = seq.slot
        if slot is None or slot not in self.fed or self.fed[slot][0] is not seq:
            return
        _, start, draft = self.fed.pop(slot)
        fed = draft[: max(0, self.held[slot] - start)]
        real = seq.token_ids[start : start + len(fed)]
        match = next((i for i, (a, b) in enumerate(zip(fed, real)) if a != b), min(len(fed), len(real)))
        self.cut(slot, min(start + match, seq.n_cached))

    def sync_all(self) -> None:
        """After a tick: every sequence that drafted or caught up (verified or not: a failed step, a chunk the
        scheduler dropped) holds no draft cell past what it keeps."""
        for seq, _, _ in list(self.fed.values()):
            self.sync(seq)
        self.fed.clear()

"""Stateful property test of the engine: random add / create / continue / fork / cancel / delete /
truncate / step on a small pool (eviction, preemption, slot pressure and chunked prefill all happen).

The machine keeps its own model of every persistent sequence's tokens and of which requests are in
flight, and predicts every refusal. Checked: after each rule, every sequence's tokens equal the model
and its cells cover exactly its cached positions; at the end, every greedy output (finished or cut by
a cancel) is a prefix of the from-scratch greedy run of its history, and once all persistent
sequences are deleted the pool is whole again.
"""

from dataclasses import dataclass, field

import pytest
from engine_support import Collector, check_cells_match_sequences, drain, greedy, greedy_oracle, make_engine
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiny_models import tiny_model

from engine.api.errors import PromptTooLong, SequenceBusy

N_CELLS = 40
MODEL = tiny_model("llama_gqa")
_ORACLE: dict[tuple[int, ...], list[int]] = {}

tokens = st.lists(st.integers(3, 100), min_size=1, max_size=10)


def oracle(history: list[int], k: int) -> list[int]:
    """Greedy continuation of `history` (cacheless argmax loop), memoised across examples."""
    key = tuple(history)
    known = _ORACLE.get(key, [])
    if len(known) < k:
        known = known + greedy_oracle(MODEL, list(history) + known, k - len(known))
        _ORACLE[key] = known
    return known[:k]


@dataclass
class Run:
    """One generation request as the machine expects it."""

    history: list[int]  # the tokens it generates after
    max_tokens: int
    n: int
    got: Collector = field(default_factory=Collector)


@dataclass
class Track:
    """A persistent sequence: tokens before its current run, plus the run (if any) and its create."""

    tokens: list[int]
    create: Collector | None = None
    run: Run | None = None

    def current(self) -> list[int]:
        return self.tokens + (self.run.got.tokens.get(0, []) if self.run else [])

    def busy(self) -> bool:
        return any(c is not None and not c.finished for c in (self.create, self.run and self.run.got))


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine = make_engine(model=MODEL, n_cells=N_CELLS, max_seqs=6, max_num_batched_tokens=16)
        self.runs: dict[str, Run] = {}
        self.creates: dict[str, Collector] = {}
        self.seqs: dict[str, Track] = {}
        self.next_id = 0

    def _rid(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _in_flight(self) -> list[str]:
        ids = [r for r, run in self.runs.items() if not run.got.finished]
        return ids + [r for r, c in self.creates.items() if not c.finished]

    # ----- rules -----------------------------------------------------------------------------
    @rule(ids=tokens, max_tokens=st.integers(1, 6), n=st.sampled_from([1, 1, 2]))
    def add(self, ids, max_tokens, n):
        run, rid = Run(ids, max_tokens, n), self._rid()
        if len(ids) + n * max_tokens > N_CELLS:
            with pytest.raises(PromptTooLong):
                self.engine.add_request(rid, ids, greedy(max_tokens, n=n), run.got)
            return
        self.engine.add_request(rid, ids, greedy(max_tokens, n=n), run.got)
        self.runs[rid] = run

    @rule(ids=tokens)
    def create(self, ids):
        got = Collector()
        seq, req = self.engine.create_sequence(ids, got)
        self.creates[req.request_id] = got
        self.seqs[seq.seq_id] = Track(list(ids), create=got)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.lists(st.integers(3, 100), max_size=3), max_tokens=st.integers(1, 6))
    def extend(self, data, extra, max_tokens):
        seq_id = data.draw(st.sampled_from(list(self.seqs)))
        track, rid = self.seqs[seq_id], self._rid()
        history = track.current() + extra
        run = Run(history, max_tokens, 1)
        if track.busy() or len(history) + max_tokens > N_CELLS:
            with pytest.raises(SequenceBusy if track.busy() else PromptTooLong):
                self.engine.add_request(rid, extra, greedy(max_tokens), run.got, seq_id=seq_id)
            return
        self.engine.add_request(rid, extra, greedy(max_tokens), run.got, seq_id=seq_id)
        self.runs[rid] = run
        track.tokens, track.run = history, run

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), frac=st.floats(0, 1))
    def fork(self, data, frac):
        track = self.seqs[data.draw(st.sampled_from(list(self.seqs)))]
        parent_id = next(k for k, v in self.seqs.items() if v is track)
        current = track.current()
        at = max(1, round(frac * len(current)))
        child = self.engine.fork(parent_id, at=at)
        self.seqs[child.seq_id] = Track(current[:at])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), frac=st.floats(0, 1))
    def truncate(self, data, frac):
        seq_id = data.draw(st.sampled_from(list(self.seqs)))
        track = self.seqs[seq_id]
        length = max(1, round(frac * len(track.current())))
        if track.busy():
            with pytest.raises(SequenceBusy):
                self.engine.truncate(seq_id, length)
            return
        self.engine.truncate(seq_id, length)
        self.seqs[seq_id] = Track(track.current()[:length])

    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(self._in_flight() + ["unknown"]))
        live = rid in self._in_flight()
        assert self.engine.cancel(rid) == live
        if live:
            got = self.runs[rid].got if rid in self.runs else self.creates[rid]
            assert got.finished and "cancelled" in got.finish.values()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def delete(self, data):
        seq_id = data.draw(st.sampled_from(list(self.seqs)))
        self.engine.delete(seq_id)
        track = self.seqs.pop(seq_id)
        assert not track.busy(), "delete cancels what runs on the sequence"

    @rule(k=st.integers(1, 4))
    def step(self, k):
        for _ in range(k):
            self.engine.step()

    # ----- checks ----------------------------------------------------------------------------
    @invariant()
    def sequences_match_the_model(self):
        assert set(self.engine.sequences) == set(self.seqs)
        for seq_id, track in self.seqs.items():
            assert self.engine.sequences[seq_id].token_ids == track.current(), seq_id
        check_cells_match_sequences(self.engine)

    def teardown(self):
        drain(self.engine)
        for rid, run in self.runs.items():
            assert run.got.finished, rid
            for i in range(run.n):
                out, reason = run.got.tokens.get(i, []), run.got.finish[i]
                assert reason in ("length", "cancelled"), (rid, i, reason, run.got.errors.get(i))
                assert len(out) == run.max_tokens if reason == "length" else len(out) <= run.max_tokens
                assert out == oracle(run.history, len(out)), (rid, i)
        for seq_id in list(self.seqs):
            self.engine.delete(seq_id)
        assert self.engine.free_cells() == N_CELLS
        assert not self.engine.scheduler.holders


EngineMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=15, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_engine_state_machine = EngineMachine.TestCase

"""Automatic prefix sharing (issue #12): a request reuses the cells of any cached prefix, and its
tokens and logprobs are exactly what it gets when everything is prefilled (the cacheless oracle).

Covered: the index itself (longest match, token-level extension, registration following n_cached);
whole and partial matches, the last prompt token always recomputed; a match ending mid-chunk; a
cached prefix evicted (whole or its tail) while a request waits; preemption of a sequence sharing
cells; seeded sampling and logprobs equal with and without the cache; persistent sequences and forks
as holders; and a hypothesis state machine mixing requests from a prefix family with forks,
truncations, cancels and deletes, checking cells == [0, n_cached) and no leak after every step.
"""

import pytest
import torch
from engine_support import (
    Collector,
    check_cells_match_sequences,
    drain,
    greedy,
    greedy_oracle,
    make_engine,
    prompt,
)
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from tiny_models import tiny_model

from engine.api.sampling_params import SamplingParams
from engine.core.prefix_index import PrefixIndex
from engine.core.sequence import Sequence

SYSTEM = prompt(40, seed=100)  # a shared "system prompt": 2 full blocks + 8 tokens


def run(engine, rid, ids, params, **kw) -> Collector:
    got = Collector()
    engine.add_request(rid, ids, params, got, **kw)
    drain(engine)
    return got


def cached_of(got: Collector) -> int:
    return got.deltas[-1].cached_tokens


# ----- the index ---------------------------------------------------------------------------------
def _holder(tokens: list[int], n_cached: int, slot: int = 0) -> Sequence:
    return Sequence("s", list(tokens), slot=slot, n_cached=n_cached)


def test_index_finds_the_longest_prefix_at_token_granularity():
    index = PrefixIndex()
    a = _holder(SYSTEM + [1, 2, 3], 43)
    b = _holder(SYSTEM[:20] + [9] * 30, 50, slot=1)
    index.update(a)
    index.update(b)
    assert index.longest(SYSTEM + [1, 2, 7, 7], limit=100) == (a, 42)  # 2 blocks, then token by token
    assert index.longest(SYSTEM[:20] + [9] * 40, limit=100) == (b, 50)  # capped by what b has cached
    assert index.longest(SYSTEM + [1, 2, 3], limit=42) == (a, 42)  # the last token stays uncached
    assert index.longest(SYSTEM[:15], limit=14) == (None, 0)  # shorter than one block: not indexed
    a.n_cached = 10  # cut below one block: a is no longer found
    index.update(a)
    assert index.longest(SYSTEM + [1], limit=100) == (b, 20)
    index.forget(b)
    assert index.longest(SYSTEM + [1], limit=100) == (None, 0) and len(index) == 0


# ----- equal outputs -----------------------------------------------------------------------------
@pytest.mark.parametrize("suffix_len", [0, 5, 23])
def test_a_shared_prefix_gives_the_oracle_tokens(model, suffix_len):
    engine = make_engine(model=model, n_cells=512)
    first = SYSTEM + prompt(7, seed=1)
    a = run(engine, "a", first, greedy(6))
    second = SYSTEM + prompt(suffix_len, seed=2) if suffix_len else list(first)
    b = run(engine, "b", second, greedy(6))
    held = first + a.tokens[0][:-1]  # what a's cells cover: all but its last generated token
    common = next((i for i, (x, y) in enumerate(zip(held, second)) if x != y), min(len(held), len(second)))
    assert cached_of(a) == 0 and cached_of(b) == min(common, len(second) - 1) >= len(SYSTEM)
    assert b.tokens[0] == greedy_oracle(model, second, 6)
    assert a.tokens[0] == greedy_oracle(model, first, 6)
    check_cells_match_sequences(engine)
    assert engine.free_cells() == 512
    engine.clear_prefix_cache()
    assert engine.cache.free_cells() == 512


def test_identical_prompt_recomputes_only_its_last_token(model):
    engine = make_engine(model=model, n_cells=512)
    ids = SYSTEM + prompt(9, seed=3)
    run(engine, "a", ids, greedy(2))
    b = run(engine, "b", ids, greedy(4))
    assert cached_of(b) == len(ids) - 1
    assert b.tokens[0] == greedy_oracle(model, ids, 4)
    stats = engine.stats()
    assert stats.prefix_hit_tokens == len(ids) - 1 and stats.prefix_queried_tokens == 2 * len(ids)


def test_a_match_that_ends_mid_chunk(model):
    engine = make_engine(model=model, n_cells=512, max_num_batched_tokens=8)
    run(engine, "a", SYSTEM + [5, 6, 7], greedy(1))
    second = SYSTEM + [5] + prompt(30, seed=4)  # matches 41 tokens, then 30 in chunks of 8 from 41
    b = run(engine, "b", second, greedy(5))
    assert cached_of(b) == len(SYSTEM) + 1
    assert b.tokens[0] == greedy_oracle(model, second, 5)


def test_seeded_sampling_and_logprobs_are_the_same_from_the_cache(model):
    ids = SYSTEM + prompt(12, seed=5)
    params = {"max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 1234, "logprobs": 3, "n": 3}
    cold_engine = make_engine(model=model, n_cells=512, prefix_caching=False)
    cold = run(cold_engine, "cold", ids, SamplingParams(**params))
    warm_engine = make_engine(model=model, n_cells=512)
    run(warm_engine, "fill", ids, greedy(1))
    warm = run(warm_engine, "warm", ids, SamplingParams(**params))
    assert cached_of(warm) == len(ids) - 1 and cached_of(cold) == 0
    assert warm.tokens == cold.tokens
    lp = [[t.logprob for d in c.deltas for o in d.outputs for t in (o.logprobs or [])] for c in (cold, warm)]
    torch.testing.assert_close(torch.tensor(lp[0]), torch.tensor(lp[1]), rtol=1e-5, atol=1e-5)


def test_persistent_sequences_and_forks_are_holders_too(model):
    engine = make_engine(model=model, n_cells=512)
    seq, _ = engine.create_sequence(SYSTEM + [4, 4])
    drain(engine)
    child = engine.fork(seq.seq_id, at=len(SYSTEM) + 1)
    ids = SYSTEM + prompt(6, seed=6)
    got = run(engine, "x", ids, greedy(5))
    assert cached_of(got) == len(SYSTEM)
    assert got.tokens[0] == greedy_oracle(model, ids, 5)
    again, _ = engine.create_sequence(SYSTEM + [4, 4, 8])
    drain(engine)
    assert engine.cache.shared_cells(again.slot) == len(SYSTEM) + 1  # all its parent has cached (not its last token)
    for s in (seq.seq_id, child.seq_id, again.seq_id):
        engine.delete(s)
    check_cells_match_sequences(engine)
    assert engine.free_cells() == 512


def test_a_continued_sequence_gains_what_another_holder_has_past_its_cells(model):
    """Two branches of one conversation get the same long user turn: the second branch shares the
    first one's cells for that turn instead of prefilling it."""
    engine = make_engine(model=model, n_cells=512)
    trunk, _ = engine.create_sequence(SYSTEM[:20])
    drain(engine)
    branch = engine.fork(trunk.seq_id)
    turn = prompt(37, seed=11)
    first = run(engine, "t1", turn, greedy(3), seq_id=trunk.seq_id)
    second = run(engine, "t2", turn, greedy(3), seq_id=branch.seq_id)
    assert cached_of(first) == 0 and cached_of(second) == len(turn) - 1
    history = SYSTEM[:20] + turn
    assert first.tokens[0] == second.tokens[0] == greedy_oracle(model, history, 3)
    check_cells_match_sequences(engine)


# ----- eviction and preemption -------------------------------------------------------------------
def test_cached_prefixes_are_evicted_before_idle_sequences(model):
    engine = make_engine(model=model, n_cells=128)
    idle, _ = engine.create_sequence(prompt(40, seed=7))
    drain(engine)
    run(engine, "c", SYSTEM + [3], greedy(2))  # leaves a 42-token cached prefix
    assert engine.stats().prefix_cached == 1
    big = prompt(60, seed=8)  # needs cells: the cached prefix's tail goes first, the idle sequence stays
    got = run(engine, "big", big, greedy(4))
    assert got.tokens[0] == greedy_oracle(model, big, 4)
    assert engine.sequence_info(idle.seq_id).n_cached == 39
    check_cells_match_sequences(engine)


def test_a_prefix_evicted_while_its_request_waits(model):
    engine = make_engine(model=model, n_cells=100, max_num_seqs=1)
    run(engine, "fill", SYSTEM + [7, 7], greedy(1))
    blocker = Collector()
    engine.add_request("blocker", prompt(50, seed=9), greedy(40), blocker)  # runs; evicts the prefix
    waiter = Collector()
    later = SYSTEM + [7, 8]
    engine.add_request("waiter", later, greedy(5), waiter)  # waits: one sequence at a time
    drain(engine)
    assert blocker.tokens[0] == greedy_oracle(model, prompt(50, seed=9), 40)
    assert waiter.tokens[0] == greedy_oracle(model, later, 5)
    check_cells_match_sequences(engine)


def test_preempting_a_sequence_that_shares_cells(model):
    engine = make_engine(model=model, n_cells=120, max_num_batched_tokens=64,
                         speculative="off")  # drafts end the sharers sooner: the pool would not run short
    run(engine, "fill", SYSTEM + [2], greedy(1))
    outs = {}
    for i in range(3):  # three sharers outgrow the pool: the newest is preempted and re-admitted
        outs[i] = Collector()
        engine.add_request(f"r{i}", SYSTEM + [10 + i], greedy(30), outs[i])
    drain(engine)
    assert engine.scheduler.preemptions > 0
    for i in range(3):
        assert outs[i].tokens[0] == greedy_oracle(model, SYSTEM + [10 + i], 30)
    check_cells_match_sequences(engine)
    assert engine.free_cells() == 120


def test_prefix_caching_off_frees_cells_at_once(model):
    engine = make_engine(model=model, n_cells=256, prefix_caching=False)
    run(engine, "a", SYSTEM, greedy(2))
    b = run(engine, "b", SYSTEM, greedy(2))
    assert cached_of(b) == 0 and engine.cache.free_cells() == 256 and engine.stats().prefix_hit_tokens == 0


# ----- everything at once ------------------------------------------------------------------------
FAMILY = [prompt(20, seed=200 + k) for k in range(3)]


class PrefixMachine(RuleBasedStateMachine):
    """Requests from a few shared prefixes, persistent sequences, forks, truncations, cancels and
    deletes in a small pool; after every step the cells of every holder are exactly [0, n_cached),
    and each finished greedy request produced the oracle's tokens."""

    def __init__(self):
        super().__init__()
        self.engine = make_engine(model=MODEL, n_cells=160, max_num_batched_tokens=24, max_num_seqs=4)
        self.pending: dict[str, tuple[list[int], int, Collector]] = {}
        self.seqs: list[str] = []
        self.next_id = 0

    def _rid(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    @rule(k=st.integers(0, 2), tail=st.lists(st.integers(3, 99), max_size=12), n_out=st.integers(1, 6))
    def request(self, k, tail, n_out):
        ids = FAMILY[k] + tail
        got = Collector()
        rid = self._rid()
        self.engine.add_request(rid, ids, greedy(n_out), got)
        self.pending[rid] = (ids, n_out, got)

    @rule(k=st.integers(0, 2), tail=st.lists(st.integers(3, 99), max_size=6))
    def create(self, k, tail):
        seq, _ = self.engine.create_sequence(FAMILY[k] + tail)
        self.seqs.append(seq.seq_id)

    @rule(i=st.integers(0, 10), at=st.integers(1, 30))
    def fork(self, i, at):
        if self.seqs:
            parent = self.seqs[i % len(self.seqs)]
            length = len(self.engine.sequences[parent].token_ids)
            self.seqs.append(self.engine.fork(parent, min(at, length)).seq_id)

    @rule(i=st.integers(0, 10), length=st.integers(1, 30))
    def truncate(self, i, length):
        if self.seqs:
            seq = self.engine.sequences[self.seqs[i % len(self.seqs)]]
            if seq.request is None:
                self.engine.truncate(seq.seq_id, min(length, len(seq.token_ids)))

    @rule(i=st.integers(0, 10))
    def delete(self, i):
        if self.seqs:
            self.engine.delete(self.seqs.pop(i % len(self.seqs)))

    @rule(i=st.integers(0, 10))
    def cancel(self, i):
        live = [r for r, (_, _, got) in self.pending.items() if not got.finished]
        if live:
            rid = live[i % len(live)]
            self.engine.cancel(rid)
            del self.pending[rid]

    @rule(n=st.integers(1, 6))
    def steps(self, n):
        for _ in range(n):
            if self.engine.has_unfinished():
                self.engine.step()

    @invariant()
    def cells_follow_n_cached(self):
        check_cells_match_sequences(self.engine)

    @invariant()
    def finished_requests_match_the_oracle(self):
        for rid, (ids, n_out, got) in list(self.pending.items()):
            if got.finished:
                assert got.tokens[0] == greedy_oracle(MODEL, ids, n_out), rid
                del self.pending[rid]

    def teardown(self):
        drain(self.engine)
        self.finished_requests_match_the_oracle()
        for seq_id in self.seqs:
            self.engine.delete(seq_id)
        self.engine.clear_prefix_cache()
        assert self.engine.cache.free_cells() == 160


MODEL = tiny_model("llama_gqa")
PrefixMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None,
                                           suppress_health_check=list(HealthCheck))
test_prefix_machine = PrefixMachine.TestCase

"""Persistent sequences (create, continue, fork, truncate, delete, idle TTL), eviction of idle cells
under pressure with exact re-prefill, and requests refused without changing anything."""

import time

import pytest
from engine_support import (
    Collector,
    check_cells_match_sequences,
    drain,
    greedy,
    greedy_oracle,
    make_engine,
    prompt,
)

from engine.api.errors import InvalidRequest, PromptTooLong, QueueFull, SequenceBusy, SequenceNotFound


def _create(engine, ids) -> str:
    seq, _ = engine.create_sequence(ids)
    drain(engine)
    return seq.seq_id


def _continue(engine, seq_id, extra, k, request_id=None) -> Collector:
    got = Collector()
    engine.add_request(request_id or f"c-{time.monotonic_ns()}", extra, greedy(k), got, seq_id=seq_id)
    return got


def test_create_continue_truncate_delete(model):
    engine = make_engine(model=model, n_cells=128)
    p = prompt(11, seed=1)
    created = Collector()
    seq, _ = engine.create_sequence(p, created)
    drain(engine)
    assert created.finished and created.tokens[0] == []  # create generates nothing
    info = engine.sequence_info(seq.seq_id)
    # Idle sequences keep their last token uncached: continuing needs that token's logits.
    assert (info.length, info.n_cached, info.cells_owned, info.status) == (11, 10, 10, "idle")

    got = _continue(engine, seq.seq_id, [7, 9], 5)
    drain(engine)
    assert got.deltas[-1].seq_id == seq.seq_id
    assert got.tokens[0] == greedy_oracle(model, p + [7, 9], 5)
    history = p + [7, 9] + got.tokens[0]
    assert engine.sequence_info(seq.seq_id).token_ids == history

    again = _continue(engine, seq.seq_id, [], 4)  # no new text: continue where it stopped
    drain(engine)
    assert again.tokens[0] == greedy_oracle(model, history, 4)

    engine.truncate(seq.seq_id, 8)
    info = engine.sequence_info(seq.seq_id)
    assert (info.token_ids, info.n_cached, info.cells_owned) == (p[:8], 7, 7)
    check_cells_match_sequences(engine)
    after = _continue(engine, seq.seq_id, [], 6)
    drain(engine)
    assert after.tokens[0] == greedy_oracle(model, p[:8], 6)

    engine.delete(seq.seq_id)
    assert engine.free_cells() == 128
    with pytest.raises(SequenceNotFound):
        engine.sequence_info(seq.seq_id)


def test_fork_a_running_sequence_after_k_tokens(model):
    n_cells = 160
    engine = make_engine(model=model, n_cells=n_cells)
    p = prompt(13, seed=2)
    parent = _create(engine, p)
    gen = _continue(engine, parent, [], 10)
    for _ in range(3):
        engine.step()
    assert len(gen.tokens[0]) == 3
    free = engine.free_cells()
    child = engine.fork(parent).seq_id  # snapshot at the tick boundary
    early = engine.fork(parent, at=9).seq_id
    assert engine.free_cells() == free, "a fork copies no K/V"
    info = engine.sequence_info(child)
    assert info.token_ids == p + gen.tokens[0] and info.parent == parent
    assert info.cells_shared == info.n_cached == len(info.token_ids) - 1
    assert engine.sequence_info(early).token_ids == p[:9]
    check_cells_match_sequences(engine)

    child_hist = info.token_ids + [5, 7]
    branch = _continue(engine, child, [5, 7], 6)
    plain = _continue(engine, early, [], 4)
    drain(engine)
    assert gen.tokens[0] == greedy_oracle(model, p, 10)
    assert branch.tokens[0] == greedy_oracle(model, child_hist, 6)
    assert plain.tokens[0] == greedy_oracle(model, p[:9], 4)
    assert engine.sequence_info(parent).token_ids == p + gen.tokens[0]  # the children changed nothing
    for s in (parent, child, early):
        engine.delete(s)
    assert engine.free_cells() == n_cells


def test_fork_when_slots_run_out_keeps_the_parents_cells(model):
    """With every slot held by an idle sequence, fork evicts some other sequence, never the parent."""
    engine = make_engine(model=model, n_cells=64, max_seqs=2)
    pa, pb = prompt(9, seed=3), prompt(6, seed=4)
    a = _create(engine, pa)
    b = _create(engine, pb)
    engine.sequences[b].last_used = engine.sequences[a].last_used + 1  # a is the least recently used
    child = engine.fork(a).seq_id
    assert engine.sequence_info(child).cells_shared == 8
    assert engine.sequence_info(b).n_cached == 0  # b gave up its slot and cells
    got = _continue(engine, child, [], 5)
    drain(engine)
    assert got.tokens[0] == greedy_oracle(model, pa, 5)
    later = _continue(engine, b, [], 3)
    drain(engine)
    assert later.tokens[0] == greedy_oracle(model, pb, 3)


def test_idle_ttl_expires_only_idle_sequences(model):
    engine = make_engine(model=model, n_cells=64, seq_ttl_s=10.0)
    idle = _create(engine, prompt(5, seed=5))
    busy = _create(engine, prompt(6, seed=6))
    _continue(engine, busy, [], 30)
    engine.step()
    now = time.monotonic()
    assert engine.expire_idle(now=now + 5) == []
    assert engine.expire_idle(now=now + 11) == [idle]
    assert set(engine.sequences) == {busy}
    drain(engine)
    assert engine.expire_idle(now=time.monotonic() + 11) == [busy]
    assert engine.free_cells() == 64


def test_idle_cells_are_evicted_under_pressure_then_reprefilled_exactly(model):
    n_cells = 40
    engine = make_engine(model=model, n_cells=n_cells)
    ps = prompt(20, seed=7)
    s = _create(engine, ps)
    assert engine.sequence_info(s).n_cached == 19
    pr = prompt(15, seed=8)
    req = Collector()
    engine.add_request("r", pr, greedy(12), req)  # 27 cells: only fits once s gives up its 19
    drain(engine)
    assert req.tokens[0] == greedy_oracle(model, pr, 12)
    assert engine.stats().preemptions == 0  # idle cells go first: nothing running was preempted
    info = engine.sequence_info(s)
    assert (info.n_cached, info.cells_owned, info.token_ids) == (0, 0, ps)  # tokens are the truth
    got = _continue(engine, s, [3], 6)
    drain(engine)
    assert got.tokens[0] == greedy_oracle(model, ps + [3], 6)


def test_idle_slots_are_evicted_when_slots_run_out(model):
    engine = make_engine(model=model, n_cells=64, max_seqs=2)
    pa, pb, pr = prompt(5, seed=9), prompt(7, seed=10), prompt(8, seed=11)
    a, b = _create(engine, pa), _create(engine, pb)
    got = Collector()
    engine.add_request("r", pr, greedy(5), got)
    drain(engine)
    assert got.tokens[0] == greedy_oracle(model, pr, 5)
    for seq_id, p in ((a, pa), (b, pb)):
        out = _continue(engine, seq_id, [], 4)
        drain(engine)
        assert out.tokens[0] == greedy_oracle(model, p, 4)


def _state(engine):
    """Everything a refused command must leave untouched."""
    return (engine.stats(), sorted(engine.requests), {k: list(s.token_ids) for k, s in engine.sequences.items()},
            [s.seq_id for s in engine.scheduler.waiting], engine.cache.owner.clone().tolist(),
            {k: (s.n_cached, s.status) for k, s in engine.sequences.items()})


def test_refused_requests_change_nothing(model):
    engine = make_engine(model=model, n_cells=64, max_queue=3)
    s = _create(engine, prompt(6, seed=12))
    busy = _create(engine, prompt(6, seed=13))
    ok = Collector()
    engine.add_request("ok", prompt(4, seed=14), greedy(3), ok)
    _continue(engine, busy, [], 3, request_id="busy-run")
    before = _state(engine)
    refused = [
        (PromptTooLong, lambda: engine.add_request("x", prompt(60, 1), greedy(10))),  # > pool
        (PromptTooLong, lambda: engine.add_request("x", prompt(20, 1), greedy(12, n=4))),  # 20 + 4 x 12 > 64
        (PromptTooLong, lambda: engine.add_request("x", [5], greedy(256))),  # > model context
        (PromptTooLong, lambda: engine.add_request("x", prompt(50, 1), greedy(10), seq_id=s)),  # history + new
        (PromptTooLong, lambda: engine.create_sequence(prompt(70, 1))),
        (SequenceBusy, lambda: engine.add_request("x", [5], greedy(3), seq_id=busy)),
        (SequenceBusy, lambda: engine.truncate(busy, 2)),
        (SequenceNotFound, lambda: engine.add_request("x", [5], greedy(3), seq_id="nope")),
        (SequenceNotFound, lambda: engine.fork("nope")),
        (SequenceNotFound, lambda: engine.truncate("nope", 1)),
        (SequenceNotFound, lambda: engine.delete("nope")),
        (InvalidRequest, lambda: engine.add_request("x", [], greedy(3))),
        (InvalidRequest, lambda: engine.create_sequence([])),
        (InvalidRequest, lambda: engine.add_request("x", [5, 101], greedy(3))),  # vocab is 101
        (InvalidRequest, lambda: engine.add_request("x", [5, -1], greedy(3))),
        (InvalidRequest, lambda: engine.add_request("x", [5, True], greedy(3))),
        (InvalidRequest, lambda: engine.add_request("ok", [5], greedy(3))),  # id already in flight
        (InvalidRequest, lambda: engine.add_request("x", [5], greedy(3, n=2), seq_id=s)),
        (InvalidRequest, lambda: engine.add_request("x", [5], greedy(3, stop_token_ids=[101]))),
        (InvalidRequest, lambda: engine.add_request("x", [5], greedy(3, logit_bias={500: 1.0}))),
        (InvalidRequest, lambda: engine.fork(s, at=0)),
        (InvalidRequest, lambda: engine.fork(s, at=7)),
        (InvalidRequest, lambda: engine.truncate(s, 0)),
        (InvalidRequest, lambda: engine.truncate(s, 7)),
    ]
    for error, call in refused:
        with pytest.raises(error):
            call()
        assert _state(engine) == before, error
    engine.add_request("q", [5], greedy(2))  # the queue now holds 3: the bound
    with pytest.raises(QueueFull):
        engine.add_request("x", [5], greedy(2))
    with pytest.raises(QueueFull):
        engine.create_sequence([5, 6])
    drain(engine)
    assert ok.tokens[0] == greedy_oracle(model, ok.deltas[0].prompt_token_ids, 3)


def test_max_tokens_zero_caches_the_prompt_and_samples_nothing(model):
    engine = make_engine(model=model, n_cells=64)
    one, many = Collector(), Collector()
    engine.add_request("one", prompt(8, seed=15), greedy(0), one)
    engine.add_request("many", prompt(5, seed=16), greedy(0, n=3), many)
    s = _create(engine, prompt(6, seed=17))
    appended = _continue(engine, s, [4, 5], 0)  # append text to a sequence without generating
    drain(engine)
    assert one.tokens == {0: []} and one.finish == {0: "length"}
    assert many.finish == {0: "length", 1: "length", 2: "length"} and not any(many.tokens.values())
    assert appended.finish == {0: "length"} and appended.tokens[0] == []
    history = prompt(6, seed=17) + [4, 5]
    info = engine.sequence_info(s)
    assert (info.token_ids, info.n_cached) == (history, 7)
    assert engine.stats().generated_tokens == 0
    got = _continue(engine, s, [], 4)
    drain(engine)
    assert got.tokens[0] == greedy_oracle(model, history, 4)
    engine.delete(s)
    assert engine.free_cells() == 64

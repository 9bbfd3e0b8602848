"""Cells paged back from the state dir (`Scheduler.page_in`, `SequenceTable.page_in`): a sequence restored lazily,
one whose cells were evicted from RAM, or a fork of one, gets its saved cells back when it is scheduled
instead of re-prefilling its history; the load leaves the room the tick's plan needs and evicts only what is
idle; its output is the oracle's."""

from engine_support import (
    Collector,
    check_cells_match_sequences,
    drain,
    greedy,
    greedy_oracle,
    make_engine,
    prompt,
)

from engine.core.state.cell_files import CHUNK


def _forwarded(engine) -> list[int]:
    """Counts the tokens every forward runs (instruments the real runner; changes nothing)."""
    seen, forward = [], engine.runner.forward_hidden
    engine.runner.forward_hidden = lambda step: seen.append(len(step.tokens)) or forward(step)
    return seen


def _continue(engine, seq_id, extra, k) -> list[int]:
    got = Collector()
    engine.add_request(f"c-{seq_id}-{len(engine.sequences[seq_id].token_ids)}", extra, greedy(k), got, seq_id=seq_id)
    drain(engine)
    return got.tokens[0]


def _saved_idle(model, tmp_path, n_cells=256, n=150):
    engine = make_engine(model=model, n_cells=n_cells, state_dir=tmp_path, speculative="off")
    seq, _ = engine.create_sequence(prompt(n, seed=4))
    drain(engine)
    return engine, seq


def test_evicted_sequence_pages_back_from_disk(model, tmp_path):
    engine, seq = _saved_idle(model, tmp_path)
    history = list(seq.token_ids)
    got = Collector()
    engine.add_request("big", prompt(200, seed=5), greedy(4), got)  # needs the idle sequence's cells
    drain(engine)
    info = engine.sequence_info(seq.seq_id)
    assert (info.n_cached, info.n_saved) == (0, len(history) - 1)  # lost in RAM, still on disk
    forwarded = _forwarded(engine)
    assert _continue(engine, seq.seq_id, [5], 4) == greedy_oracle(model, history + [5], 4)
    assert max(forwarded) <= 2  # the history came from disk: only its last token and the new one ran
    check_cells_match_sequences(engine)


def test_page_in_keeps_the_reserve_and_evicts_only_idle(model, tmp_path):
    engine, seq = _saved_idle(model, tmp_path)
    engine.scheduler.release(seq)
    assert engine.scheduler.page_in(seq, reserve=200) == 0  # 200 + a chunk do not fit 256 cells: nothing loaded
    assert seq.n_cached == 0 and engine.cache.used_cells() == 0
    other, _ = engine.create_sequence(prompt(100, seed=6))
    drain(engine)
    assert engine.scheduler.page_in(seq, reserve=100) == len(seq.token_ids) - 1
    assert engine.cache.free_cells() >= 100 and other.n_cached == 0  # the idle sequence made room
    check_cells_match_sequences(engine)
    engine.add_request("run", [], greedy(1), Collector(), seq_id=other.seq_id)
    engine.scheduler.schedule()  # `other` runs now (its prefill planned): never evicted to page anything in
    engine.scheduler.release(seq)
    assert engine.scheduler.page_in(seq, reserve=250) == 0 and other.slot is not None


def test_fork_of_a_lazily_restored_sequence_loads_its_parents_chunks(model, tmp_path):
    _, seq = _saved_idle(model, tmp_path, n_cells=1024)
    again = make_engine(model=model, n_cells=1024, state_dir=tmp_path, speculative="off")
    child = again.fork(seq.seq_id, 100)
    assert again.sequence_info(child.seq_id).n_saved == CHUNK  # the parent's whole chunks, named by its record
    forwarded = _forwarded(again)
    assert _continue(again, child.seq_id, [], 3) == greedy_oracle(model, seq.token_ids[:100], 3)
    assert forwarded[0] == 100 - CHUNK  # the tail past the last whole chunk is recomputed, the rest loaded
    assert _continue(again, seq.seq_id, [7], 3) == greedy_oracle(model, seq.token_ids + [7], 3)
    assert max(forwarded[1:]) <= 2  # the parent found the child's cells in the pool, the rest on disk

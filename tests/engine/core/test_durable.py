"""Durable sequences (engine/core/state): a fork family written to a state dir comes back in a new engine
under the same ids, with the same tokens and its cells (shared once: at start with `state_eager`, else when
each sequence is next scheduled), and continues exactly as it would have without the restart; cells a
sequence lost in RAM come back from disk, not from a recompute; another model's cells are refused
(recompute); archives move a family; limits hold."""

import errno
import logging
import shutil

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
from tiny_models import full_logits, tiny_model

from engine.api.errors import IncompatibleState, StorageFull
from engine.core.state import sequence_files
from engine.core.state.cell_files import CHUNK
from engine.core.state.store import StateDirError

N_CELLS = 1024


def _continue(engine, seq_id, extra, k) -> list[int]:
    got = Collector()
    engine.add_request(f"c-{seq_id}-{len(engine.sequences[seq_id].token_ids)}", extra, greedy(k), got, seq_id=seq_id)
    drain(engine)
    return got.tokens[0]


def _family(engine) -> dict[str, str]:
    """A root over a 150-token prompt (3 chunks), forks at its end and mid-chunk, a truncated fork, one continued."""
    root, _ = engine.create_sequence(prompt(150, seed=1))
    drain(engine)
    ids = {"root": root.seq_id, "whole": engine.fork(root.seq_id).seq_id, "mid": engine.fork(root.seq_id, 100).seq_id}
    ids["cut"] = engine.fork(root.seq_id).seq_id
    engine.truncate(ids["cut"], 70)
    _continue(engine, ids["whole"], [7, 9], 12)
    _continue(engine, ids["cut"], [11], 5)
    return ids


def _forwarded(engine) -> list[int]:
    """Counts the tokens every forward runs (instruments the real runner; changes nothing)."""
    seen, forward = [], engine.runner.forward_hidden
    engine.runner.forward_hidden = lambda step: seen.append(len(step.tokens)) or forward(step)
    return seen


@pytest.fixture
def saved(model, tmp_path):
    engine = make_engine(model=model, n_cells=N_CELLS, state_dir=tmp_path)
    ids = _family(engine)
    return engine, ids, tmp_path


def test_family_comes_back_with_same_ids_tokens_and_shared_cells(model, saved):
    before, ids, state = saved
    lazy = make_engine(model=model, n_cells=N_CELLS, state_dir=state)
    again = make_engine(model=model, n_cells=N_CELLS, state_dir=state, state_eager=True)
    assert set(again.sequences) == set(lazy.sequences) == set(before.sequences)
    for seq_id in before.sequences:
        info, was, back = again.sequence_info(seq_id), before.sequence_info(seq_id), lazy.sequence_info(seq_id)
        assert (info.token_ids, info.parent, info.n_cached) == (was.token_ids, was.parent, len(was.token_ids) - 1)
        assert (back.token_ids, back.n_cached, back.n_saved) == (was.token_ids, 0, len(was.token_ids) - 1)
    assert lazy.cache.used_cells() == 0  # lazy: nothing loaded before it is used
    assert again.cache.used_cells() == before.cache.used_cells()  # the family's prefix is in the pool once
    check_cells_match_sequences(again)
    files = list((state / "cells").glob("*.safetensors"))
    longest = max(len(s.token_ids) for s in before.sequences.values())
    assert len(files) < 2 * -(-longest // CHUNK) + len(ids)  # shared chunks written once, not per sequence


def test_restored_cells_give_the_logits_of_a_recompute(model, saved):
    _, ids, state = saved
    again = make_engine(model=model, n_cells=N_CELLS, state_dir=state, state_eager=True)
    for seq_id in ids.values():
        seq = again.sequences[seq_id]
        logits = again.runner.run({seq.slot: ([seq.token_ids[-1]], seq.n_cached)})[seq.slot]
        torch.testing.assert_close(logits, full_logits(model, seq.token_ids)[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("eager", [False, True])
def test_continuation_after_restart_equals_continuation_without(model, saved, eager, tmp_path):
    before, ids, state = saved
    shutil.copytree(state, tmp_path / "copy")  # `before` goes on writing to its own folder
    again = make_engine(model=model, n_cells=N_CELLS, state_dir=tmp_path / "copy", state_eager=eager)
    forwarded = _forwarded(again)
    for name, seq_id in ids.items():
        history = list(before.sequences[seq_id].token_ids)
        expected = _continue(before, seq_id, [5], 6)
        assert expected == greedy_oracle(model, history + [5], 6)
        assert _continue(again, seq_id, [5], 6) == expected, name
    assert max(forwarded) <= 2 * len(ids)  # no re-prefill: one step runs at most the last + new token of each
    check_cells_match_sequences(again)
    assert again.cache.used_cells() < sum(len(s.token_ids) for s in again.sequences.values()) / 2  # shared


def test_cached_tokens_after_restart_cover_the_whole_history(model, saved):
    _, ids, state = saved
    again = make_engine(model=model, n_cells=N_CELLS, state_dir=state)
    history = list(again.sequences[ids["whole"]].token_ids)
    got = Collector()
    again.add_request("plain", history + [3], greedy(2), got)  # no sequence: the prefix cache finds the restored cells
    drain(again)
    assert got.deltas[-1].cached_tokens == len(history) - 1  # all but the last history token (never cached idle)
    assert again.sequence_info(ids["whole"]).n_saved == len(history) - 1  # found on disk: the chunks are shared


def test_another_models_cells_are_refused_and_recomputed(saved, caplog):
    _, ids, state = saved
    other = tiny_model("llama_gqa", seed=1)
    with caplog.at_level(logging.WARNING, logger="cellserve.state"):
        again = make_engine(model=other, n_cells=N_CELLS, state_dir=state)
    assert "written by another model" in caplog.text
    assert all(again.sequence_info(s).n_cached == 0 for s in ids.values())
    history = list(again.sequences[ids["mid"]].token_ids)
    assert _continue(again, ids["mid"], [], 4) == greedy_oracle(other, history, 4)


def test_delete_and_truncate_are_durable_and_collect_cells(model, saved):
    before, ids, state = saved
    before.delete(ids["whole"])
    before.truncate(ids["mid"], 20)
    again = make_engine(model=model, n_cells=N_CELLS, state_dir=state)
    assert ids["whole"] not in again.sequences
    assert again.sequences[ids["mid"]].token_ids == before.sequences[ids["mid"]].token_ids[:20]
    named = {k for r in again.persistent.store.records.values() for k in r.chunks}
    assert {p.stem for p in (state / "cells").glob("*.safetensors")} == named  # no orphan chunk left


def test_export_import_moves_a_family(model, saved, tmp_path):
    before, ids, _ = saved
    blob = before.export_sequences(ids["mid"], family=True)
    elsewhere = make_engine(model=model, n_cells=N_CELLS)  # no state dir: archives need none
    made = list(elsewhere.import_sequences(blob).values())
    assert set(made) == set(before.sequences)  # the ids were free here: kept
    again = list(elsewhere.import_sequences(blob).values())  # taken now: new ids, forks follow their parent's
    assert not set(again) & set(made)
    for seq_id in made:
        assert elsewhere.sequence_info(seq_id).n_cached == len(before.sequences[seq_id].token_ids) - 1
    root = before.sequences[ids["root"]]
    assert {elsewhere.sequences[s].parent for s in again} - {None} <= set(again)
    assert _continue(elsewhere, ids["mid"], [4], 5) == _continue(before, ids["mid"], [4], 5)
    assert len(before.export_sequences(ids["mid"])) < len(blob) and root.seq_id in made
    with pytest.raises(IncompatibleState, match="another model"):
        make_engine(model=tiny_model("llama_gqa", seed=1), n_cells=N_CELLS).import_sequences(blob)


def test_byte_budget_drops_least_recently_used_families(model, tmp_path):
    engine = make_engine(model=model, n_cells=N_CELLS, state_dir=tmp_path)
    old, _ = engine.create_sequence(prompt(130, seed=2))
    drain(engine)
    one_family = engine.persistent.store.cells.total_bytes
    engine.persistent.store.max_bytes = int(1.5 * one_family)
    new, _ = engine.create_sequence(prompt(130, seed=3))
    drain(engine)
    records = engine.persistent.store.records
    assert records[old.seq_id].chunks == [] and records[new.seq_id].chunks  # the older family went to recompute
    assert engine.persistent.store.cells.total_bytes <= int(1.5 * one_family)
    again = make_engine(model=model, n_cells=N_CELLS, state_dir=tmp_path)
    assert again.sequences[old.seq_id].token_ids == engine.sequences[old.seq_id].token_ids  # tokens kept
    assert (again.sequence_info(old.seq_id).n_saved, again.sequence_info(new.seq_id).n_saved) == (0, 129)


def test_disk_full_is_storage_full_and_loses_nothing(model, saved, monkeypatch):
    before, ids, state = saved
    seq_id = ids["whole"]
    _continue(before, seq_id, [8], 3)  # acknowledged and written
    written = list(before.sequences[seq_id].token_ids)

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sequence_files, "write_atomic", full)
    monkeypatch.setattr("engine.core.state.cell_files.write_atomic", full)
    _continue(before, seq_id, [9], 3)  # logged, not raised: the sequence lives on in memory
    with pytest.raises(StorageFull, match="free space"):
        before.save_sequence(seq_id)
    assert before.sequences[seq_id].token_ids[: len(written)] == written
    monkeypatch.undo()
    again = make_engine(model=model, n_cells=N_CELLS, state_dir=state)
    assert again.sequences[seq_id].token_ids == written  # the last state the disk took


def test_unusable_dir_and_bad_files(model, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StateDirError, match="not usable"):
        make_engine(model=model, n_cells=64, state_dir=blocker / "state")
    (tmp_path / "s" / "sequences").mkdir(parents=True)
    (tmp_path / "s" / "sequences" / "seq-a.json").write_text('{"v": 1, "id": "../../etc/x", "token_ids": [1]}')
    (tmp_path / "s" / "sequences" / "seq-b.json").write_text("{torn")
    with caplog.at_level(logging.ERROR, logger="cellserve.state"):
        engine = make_engine(model=model, n_cells=64, state_dir=tmp_path / "s")
    assert engine.sequences == {} and caplog.text.count("not a valid sequence record") == 2


def test_an_import_into_a_pool_full_of_cached_prefixes_evicts_them(model, saved):
    """Cached prefixes are a cache: an imported family takes their cells as a prefill would, rather than
    arriving with none and being recomputed when it next runs."""
    before, ids, _ = saved
    blob = before.export_sequences(ids["mid"], family=True)
    elsewhere = make_engine(model=model, n_cells=320)
    for seed in range(3):  # three finished 100-token requests: ~300 cells held as cached prefixes
        elsewhere.add_request(f"fill-{seed}", prompt(100, seed=10 + seed), greedy(2), Collector())
        drain(elsewhere)
    assert elsewhere.cached_prefix_cells() > 250 and elsewhere.cache.free_cells() < 100  # the pool's own free cells
    made = elsewhere.import_sequences(blob)
    for seq_id in made.values():
        assert elsewhere.sequence_info(seq_id).n_cached == len(before.sequences[seq_id].token_ids) - 1
    assert _continue(elsewhere, ids["mid"], [4], 5) == _continue(before, ids["mid"], [4], 5)
    check_cells_match_sequences(elsewhere)

"""The engine over int8 KV cells: everything that touches cells works as over float cells. Forks share int8
cells, cancels and deletes free them (no cell leaks), preemption and re-prefill, prefix caching and
speculative decoding (rejected drafts trimmed) give the output of a plain int8 run, and durable state
saves int8 rows with their scales, restores them without a recompute and refuses them under float cells
(and the reverse), as it refuses another model's.

The oracle for "the same output" is the same int8 engine run plainly (one request at a time, no drafts,
no preemption): int8 cells round K/V, so the float oracle can differ at a near tie of these tiny random
models; where the float oracle is the check (a restored family's continuation) the prompt's margins are
checked by the test that uses it.
"""

import logging
import shutil

import pytest
from engine_support import (
    Collector,
    check_cells_match_sequences,
    drain,
    greedy,
    greedy_oracle,
    prompt,
    run_requests,
)
from tiny_models import tiny_model

from engine.api.args import EngineArgs
from engine.api.errors import IncompatibleState
from engine.core.engine import Engine
from engine.core.state.cell_files import CellFiles
from engine.core.state.identity import identity_of
from engine.model.runner import ModelRunner

REPEATING = prompt(7, 1) * 5  # a history whose continuation prompt lookup can guess


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama_gqa")


def _engine(model, kv="int8", n_cells=512, **config) -> Engine:
    runner = ModelRunner(model, n_cells=n_cells, max_seqs=256, kv_cache_dtype=kv)
    return Engine(runner, EngineArgs(kv_cache_dtype=kv, **config))


def _run(engine, prompts, params, check=True) -> list[list[int]]:
    outs = run_requests(engine, prompts, params, check=check_cells_match_sequences if check else None,
                        tag=f"r{len(engine.requests)}-{engine.steps}-")
    return [o.tokens[0] for o in outs]


def _alone(model, prompts, params) -> list[list[int]]:
    engine = _engine(model, speculative=None, prefix_caching=False)
    return [_run(engine, [p], params)[0] for p in prompts]


PROMPTS = [REPEATING, prompt(20, 2), REPEATING[:13], prompt(5, 3) * 4, prompt(33, 4)]


def test_speculative_drafts_over_int8_cells_change_no_output_and_leak_no_cell(model):
    want = _alone(model, PROMPTS, greedy(24))
    engine = _engine(model, speculative="ngram")
    assert engine.cache.kv_dtype is not None
    assert _run(engine, PROMPTS, greedy(24)) == want
    assert engine.speculative.accepted > 0 and engine.speculative.drafted > engine.speculative.accepted  # some trimmed
    engine.clear_prefix_cache()
    assert engine.cache.used_cells() == 0


def test_preemption_and_prefix_cache_over_int8_cells_give_the_plain_output(model):
    want = _alone(model, PROMPTS, greedy(12))
    small = _engine(model, n_cells=64, speculative=None)  # every prompt fits alone, not all together
    assert _run(small, PROMPTS, greedy(12)) == want
    assert small.stats().preemptions > 0
    cached = _engine(model, speculative=None)
    assert _run(cached, PROMPTS, greedy(12)) == want
    again = Collector()
    cached.add_request("again", PROMPTS[4] + want[4][:3], greedy(9), again)
    drain(cached)
    assert again.deltas[-1].cached_tokens >= len(PROMPTS[4])  # the finished request's int8 cells were reused
    assert again.tokens[0] == want[4][3:]
    cached.clear_prefix_cache()
    assert cached.cache.used_cells() == 0


def test_forks_share_int8_cells_and_cancel_and_delete_free_them(model):
    engine = _engine(model, speculative=None)
    root, _ = engine.create_sequence(prompt(40, 5))
    drain(engine)
    used = engine.cache.used_cells()
    forks = [engine.fork(root.seq_id), engine.fork(root.seq_id, 20)]
    assert engine.cache.used_cells() == used  # forks copy no K/V: they own the same int8 cells
    outs = []
    for i, f in enumerate(forks):
        out = Collector()
        engine.add_request(f"f{i}", [7 + i], greedy(6), out, seq_id=f.seq_id)
        outs.append(out)
    drain(engine)
    check_cells_match_sequences(engine)
    want = _alone(model, [root.token_ids + [7], root.token_ids[:20] + [8]], greedy(6))
    assert [o.tokens[0] for o in outs] == want
    engine.add_request("gone", prompt(30, 6), greedy(50), Collector())
    engine.step()
    engine.step()
    assert engine.cancel("gone")
    drain(engine)
    for f in forks:
        engine.delete(f.seq_id)
    engine.delete(root.seq_id)
    engine.clear_prefix_cache()
    assert engine.cache.used_cells() == 0


def _continue(engine, seq_id, extra, k) -> list[int]:
    got = Collector()
    engine.add_request(f"c-{seq_id}-{len(engine.sequences[seq_id].token_ids)}", extra, greedy(k), got, seq_id=seq_id)
    drain(engine)
    return got.tokens[0]


def test_durable_int8_cells_come_back_without_a_recompute_and_are_refused_by_float_cells(model, tmp_path, caplog):
    before = _engine(model, speculative=None, state_dir=tmp_path / "state")
    root, _ = before.create_sequence(prompt(150, 1))  # 3 chunk files
    drain(before)
    fork = before.fork(root.seq_id, 100)
    _continue(before, fork.seq_id, [9], 4)
    files = list((tmp_path / "state" / "cells").glob("*.safetensors"))
    assert files
    shutil.copytree(tmp_path / "state", tmp_path / "copy")
    again = _engine(model, speculative=None, state_dir=tmp_path / "copy", state_eager=True)
    seen = []
    forward = again.runner.forward_hidden
    again.runner.forward_hidden = lambda step: seen.append(len(step.tokens)) or forward(step)
    for seq_id in (root.seq_id, fork.seq_id):
        assert again.sequence_info(seq_id).n_cached == len(before.sequences[seq_id].token_ids) - 1
        assert _continue(again, seq_id, [5], 5) == _continue(before, seq_id, [5], 5)
    assert max(seen) <= 2  # no re-prefill: the int8 rows and their scales came back from disk
    check_cells_match_sequences(again)

    with caplog.at_level(logging.WARNING, logger="cellserve.state"):
        other = _engine(model, kv="auto", speculative=None, state_dir=tmp_path / "state")
    assert "written by another model" in caplog.text  # chunk keys hash the identity: float cells find none
    assert other.sequence_info(root.seq_id).n_cached == 0 and other.sequence_info(root.seq_id).n_saved == 0
    with pytest.raises(IncompatibleState, match="kv-int8"):  # and a chunk's header says why, if one were asked for
        saved = next((tmp_path / "state" / "cells").glob("*.safetensors"))  # left on disk, as the log says
        CellFiles(tmp_path / "state", identity_of(other.runner)).read(saved.stem)
    history = list(other.sequences[root.seq_id].token_ids)
    assert _continue(other, root.seq_id, [5], 5) == greedy_oracle(model, history + [5], 5)  # recomputed in float
    blob = before.export_sequences(root.seq_id)
    with pytest.raises(IncompatibleState, match="kv-int8"):
        _engine(model, kv="auto").import_sequences(blob)
    moved = _engine(model).import_sequences(blob)[root.seq_id]  # int8 to int8: the archive's rows as they were
    assert moved == root.seq_id

"""A forward that raises fails only that step's requests (finish_reason `error`), releases their
cells, and the engine keeps serving; requests that were not in the step are untouched."""

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
from tiny_models import tiny_model

from engine.api.sampling_params import SamplingParams
from engine.model.native.attention import Attend


class Boom(RuntimeError):
    pass


@pytest.fixture
def model():
    return tiny_model("llama_gqa")


def _fail_next_forward(monkeypatch, model, layer=1):
    """Make decoder layer `layer` raise on its next call only (the model is real; one layer misbehaves),
    whichever path the runner takes: the transformers modules or the native forward (engine/model/native/model.py)."""
    target = model.model.layers[layer]
    original, attend = target.forward, Attend.__call__
    calls = []

    def boom(*args, **kwargs):
        monkeypatch.setattr(target, "forward", original)
        monkeypatch.setattr(Attend, "__call__", attend)
        raise Boom("injected failure")

    def native_layer(self, *args, **kwargs):  # called once per layer, in order
        calls.append(None)
        if len(calls) > layer:
            boom()
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(target, "forward", boom)
    monkeypatch.setattr(Attend, "__call__", native_layer)


def test_failed_forward_fails_only_its_step(monkeypatch, model):
    n_cells = 128
    engine = make_engine(model=model, n_cells=n_cells, max_num_seqs=2)
    a, b, c = Collector(), Collector(), Collector()
    pa, pb, pc = prompt(7, 1), prompt(12, 2), prompt(9, 3)
    engine.add_request("a", pa, greedy(8), a)
    engine.add_request("b", pb, greedy(8), b)
    engine.step()
    engine.step()
    engine.add_request("c", pc, greedy(6), c)  # waits: two sequences already run
    _fail_next_forward(monkeypatch, model)
    engine.step()
    for got in (a, b):
        assert got.finished and got.finish == {0: "error"} and "injected failure" in got.errors[0]
        assert len(got.tokens[0]) == 2  # what came before the failure stands
    assert engine.free_cells() == n_cells  # the step's claimed cells and a's and b's are released
    assert not c.deltas
    drain(engine)
    assert c.finish[0] == "length" and c.tokens[0] == greedy_oracle(model, pc, 6)
    d = Collector()
    engine.add_request("d", pa, greedy(8), d)  # a's prompt again, now served in full
    drain(engine)
    assert d.tokens[0] == greedy_oracle(model, pa, 8)
    assert engine.free_cells() == n_cells


def test_failed_forward_leaves_a_persistent_sequence_usable(monkeypatch, model):
    engine = make_engine(model=model, n_cells=64)
    p = prompt(10, 4)
    seq, _ = engine.create_sequence(p)
    drain(engine)
    run = Collector()
    engine.add_request("run", [8], greedy(10), run, seq_id=seq.seq_id)
    engine.step()
    engine.step()
    _fail_next_forward(monkeypatch, model, layer=0)
    engine.step()
    assert run.finish == {0: "error"}
    info = engine.sequence_info(seq.seq_id)
    assert info.status == "idle" and info.token_ids == p + [8] + run.tokens[0]
    check_cells_match_sequences(engine)
    again = Collector()
    engine.add_request("again", [], greedy(5), again, seq_id=seq.seq_id)
    drain(engine)
    assert again.tokens[0] == greedy_oracle(model, info.token_ids, 5)


def test_failed_prefill_of_n4_fails_every_choice(monkeypatch, model):
    engine = make_engine(model=model, n_cells=64)
    got = Collector()
    engine.add_request("m", prompt(10, 5), SamplingParams(n=4, max_tokens=5, seed=3), got)
    _fail_next_forward(monkeypatch, model)
    engine.step()
    assert got.finished and got.finish == {i: "error" for i in range(4)}
    assert engine.free_cells() == 64 and not engine.has_unfinished()


def test_cancel_of_n4_before_its_prefill_ends_every_choice(model):
    engine = make_engine(model=model, n_cells=64)
    got = Collector()
    engine.add_request("m", prompt(10, 6), SamplingParams(n=4, max_tokens=5, seed=3), got)
    assert engine.cancel("m")
    assert got.finished and got.finish == {i: "cancelled" for i in range(4)}
    assert engine.free_cells() == 64 and not engine.has_unfinished()


def test_a_failure_taking_one_requests_token_fails_that_request_alone(monkeypatch, model):
    """A bug in one request's output processing (detokenizer, stop check) fails that request only;
    the others sampled in the same step go on to their reference tokens."""
    engine = make_engine(model=model, n_cells=128)
    bad, good = Collector(), Collector()
    pg = prompt(9, 8)
    engine.add_request("bad", prompt(7, 7), SamplingParams(n=2, max_tokens=6, seed=1), bad)
    engine.add_request("good", pg, greedy(6), good)
    real_append = engine.outputs.append

    def append(seq, token, lp):
        if seq.request.request_id == "bad" and seq.num_generated >= 2:
            raise Boom("output processing failed")
        return real_append(seq, token, lp)

    monkeypatch.setattr(engine.outputs, "append", append)
    drain(engine)
    assert bad.finished and bad.finish == {0: "error", 1: "error"} and "output processing failed" in bad.errors[0]
    assert good.finish[0] == "length" and good.tokens[0] == greedy_oracle(model, pg, 6)
    assert engine.free_cells() == 128 and not engine.has_unfinished()

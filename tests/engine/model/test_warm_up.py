"""ModelRunner.warm_up: the first steps' shapes run once at load, leaving the pool exactly as it was."""

import pytest
import torch
from tiny_models import tiny_model

from engine.api.args import EngineArgs
from engine.api.sampling_params import SamplingParams
from engine.core.engine import Engine
from engine.model.runner import ModelRunner


def test_warm_up_leaves_an_empty_pool_and_changes_no_logits():
    model = tiny_model("llama_gqa")
    warm, cold = ModelRunner(model, n_cells=512), ModelRunner(model, n_cells=512)
    warm.warm_up(300, 8)  # capped by the pool: 255 prefill tokens, a decode and 9 drafted rows fit 512 cells
    assert warm.cache.used_cells() == 0 and warm.cache.read_len == 0
    prompt = [(7 * i + 3) % 100 for i in range(40)]
    got, want = warm.run({1: (prompt, 0)}), cold.run({1: (prompt, 0)})
    assert torch.equal(got[1], want[1])
    nxt = int(want[1].argmax())
    assert torch.equal(warm.run({1: ([nxt], 40)})[1], cold.run({1: ([nxt], 40)})[1])


def test_warm_up_refuses_a_pool_in_use_and_leaves_it_as_it_was():
    runner = ModelRunner(tiny_model("llama_gqa"), n_cells=128)
    runner.run({2: ([5, 6, 7], 0)})
    with pytest.raises(RuntimeError, match="empty cell pool"):
        runner.warm_up(16, 4)
    assert runner.cache.used_cells() == 3 and runner.cache.seq_len(2) == 3


def test_an_engine_built_from_args_warms_up_unless_told_not_to(model_dir, monkeypatch):
    calls = []
    real = ModelRunner.warm_up
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self, *a: (calls.append(a), real(self, *a)))
    outs = []
    for warmup in (True, False):  # with a draft model (the same folder): its runner warms up too
        engine = Engine.from_args(EngineArgs(model=model_dir, n_cells=256, warmup=warmup, max_num_batched_tokens=64,
                                             draft_model=model_dir))
        assert engine.cache.used_cells() == 0 and engine.speculative.drafter.cache.used_cells() == 0
        outs.append(_greedy(engine, [5, 9, 11, 4]))
    # the prefill capped by max_num_batched_tokens; the draft model drafts one row a step
    assert calls == [(64, EngineArgs().num_speculative_tokens), (64, 0)]
    assert outs[0] == outs[1]


def _greedy(engine: Engine, prompt: list[int]) -> list[int]:
    out = []
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0), out.append, detokenize=False)
    while engine.has_unfinished():
        engine.step()
    return [t for d in out for c in d.outputs for t in c.token_ids]


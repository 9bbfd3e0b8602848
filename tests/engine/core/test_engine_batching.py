"""Continuous batching (issue #4): many sequences in one flat step produce exactly what each produces
alone — greedy and seeded sampling, with chunked prefill, with preemption and re-prefill, with n > 1
sharing the prompt's cells — and cancel releases cells at once."""

import pytest
from engine_support import (
    Collector,
    check_cells_match_sequences,
    drain,
    generate_oracle,
    greedy,
    greedy_oracle,
    make_engine,
    prompt,
)
from tiny_models import tiny_model

from engine.api.sampling_params import SamplingParams
from engine.core.llm import LLM
from engine.model.runner import ModelRunner

PROMPTS = [prompt(2 + 3 * i, seed=i) for i in range(16)]  # 2 .. 47 tokens
MAX_TOKENS = 10


def _llm(model, n_cells=512, **kw) -> LLM:
    return LLM(runner=ModelRunner(model, n_cells=n_cells), **kw)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("model_name", ["llama_gqa", "qwen2_sliding", "gpt2"])
def test_batched_greedy_equals_solo_and_generate(model_name):
    model = tiny_model(model_name)
    params = greedy(MAX_TOKENS)
    # A small token budget forces chunked prefills to share steps with decodes.
    batched = _llm(model, max_num_batched_tokens=32).generate(PROMPTS, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in batched)
    solo_llm = _llm(model)
    for p, out in zip(PROMPTS, batched):
        solo = solo_llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
        assert out.outputs[0].token_ids == solo
        assert solo == generate_oracle(model, p, MAX_TOKENS)
    assert solo_llm.engine.free_cells() == 512


def test_preemption_resumes_with_identical_output():
    model = tiny_model("llama_gqa")
    params = greedy(MAX_TOKENS)
    expected = _tokens(_llm(model).generate(PROMPTS, params, use_tqdm=False))
    # The largest request (47 + 10 tokens) just fits; sixteen of them together cannot.
    llm = _llm(model, n_cells=64)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.stats().preemptions > 0
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(PROMPTS)
    assert _tokens(outs) == expected
    assert llm.engine.free_cells() == 64


def test_preempted_seeded_sampling_is_unchanged():
    """A preempted sequence keeps its generator: re-prefill does not replay or skip random draws."""
    model = tiny_model("llama_gqa")
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    expected = _tokens(_llm(model).generate(PROMPTS, params, use_tqdm=False))
    llm = _llm(model, n_cells=64)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.stats().preemptions > 0
    assert _tokens(outs) == expected


def test_n4_shares_prompt_cells_and_each_choice_is_its_own_seed():
    model = tiny_model("llama_gqa")
    n_cells, p = 128, prompt(20, seed=7)
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    engine = make_engine(model=model, n_cells=n_cells)
    got = Collector()
    req = engine.add_request("r", p, params, got)
    engine.step()  # prefill once, sample the first token of all four choices
    assert len(req.seqs) == 4
    assert engine.free_cells() == n_cells - len(p)  # the prompt is held once
    for seq in req.seqs:
        assert engine.cache.shared_cells(seq.slot) == len(p)
    engine.step()  # each choice decodes its first token into its own cell
    assert engine.free_cells() == n_cells - len(p) - 4
    check_cells_match_sequences(engine)
    drain(engine)
    assert engine.free_cells() == n_cells
    choices = [got.tokens[i] for i in range(4)]
    assert len({tuple(c) for c in choices}) == 4, "four seeded choices should differ"
    assert all(got.finish[i] == "length" and len(choices[i]) == 8 for i in range(4))
    for i in range(4):
        solo = _llm(model).generate([p], SamplingParams(max_tokens=8, temperature=1.0, seed=1234 + i,
                                                         ignore_eos=True), use_tqdm=False)
        assert solo[0].outputs[0].token_ids == choices[i]


def test_n2_greedy_choices_are_identical_and_the_prompt_is_prefilled_once():
    model = tiny_model("llama_gqa")
    p = prompt(12, seed=3)
    engine = make_engine(model=model)
    got = Collector()
    engine.add_request("r", p, greedy(6, n=2), got)
    drain(engine)
    assert engine.stats().prompt_tokens == len(p)
    assert got.tokens[0] == got.tokens[1] == greedy_oracle(model, p, 6)


def test_seeded_sampling_is_the_same_alone_and_batched():
    model = tiny_model("llama_gqa")
    target = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=20, seed=42, ignore_eos=True)
    alone = _llm(model).generate([PROMPTS[5]], target, use_tqdm=False)[0].outputs[0].token_ids
    prompts = PROMPTS[:9]  # the target is prompt 5, in the middle of eight others
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True) for i in range(9)]
    params[5] = target
    outs = _llm(model, max_num_batched_tokens=24).generate(prompts, params, use_tqdm=False)
    assert outs[5].outputs[0].token_ids == alone
    unseeded = _llm(model).generate([PROMPTS[5]] * 2, SamplingParams(max_tokens=12, temperature=1.0),
                                    use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) == 2, "no seed: fresh randomness each time"


def test_cancel_mid_generation_frees_cells_and_spares_the_others():
    model = tiny_model("llama_gqa")
    n_cells = 128
    engine = make_engine(model=model, n_cells=n_cells)
    a, b = Collector(), Collector()
    pa, pb = prompt(9, seed=1), prompt(14, seed=2)
    engine.add_request("a", pa, greedy(20), a)
    engine.add_request("b", pb, greedy(12), b)
    for _ in range(4):
        engine.step()
    assert engine.cancel("a")
    assert a.finished and a.finish[0] == "cancelled"
    assert engine.free_cells() == n_cells - (len(pb) + 3)  # b holds prompt + 3 decoded tokens
    assert a.tokens[0] == greedy_oracle(model, pa, 4)  # what a produced before the cancel stands
    n_deltas = len(a.deltas)
    assert not engine.cancel("a") and not engine.cancel("nope")  # twice, unknown: harmless
    assert len(a.deltas) == n_deltas
    drain(engine)
    assert b.finish[0] == "length" and b.tokens[0] == greedy_oracle(model, pb, 12)
    assert engine.free_cells() == n_cells


def test_cancel_before_first_step_and_cancel_of_n4():
    engine = make_engine(n_cells=64)
    queued, many = Collector(), Collector()
    engine.add_request("q", prompt(10, seed=1), greedy(5), queued)
    engine.add_request("m", prompt(10, seed=2), SamplingParams(n=4, max_tokens=5, seed=1), many)
    assert engine.cancel("q")
    assert queued.finish == {0: "cancelled"} and queued.tokens[0] == []
    engine.step()  # m prefilled once and forked into four
    assert engine.cancel("m")
    assert many.finished and set(many.finish.values()) == {"cancelled"}
    assert not engine.has_unfinished() and engine.free_cells() == 64

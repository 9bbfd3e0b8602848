"""SamplingParams validation and the vectorised Sampler against independent oracles.

Every random draw is seeded, so the statistical checks are deterministic and cannot flake.
"""

import math

import pytest
import torch

from engine.api.errors import InvalidRequest
from engine.api.sampling_params import SamplingError, SamplingParams
from engine.core.output_processor import check_stop_token
from engine.sample.sampler import Sampler, SampleResult, make_generator

sample = Sampler()


def gen(seed: int) -> torch.Generator:
    return make_generator(SamplingParams(seed=seed))


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n independent draws from one logits row: n rows, each with its own seeded generator."""
    logits = logits_row.expand(n, -1)
    res = sample(logits, [params] * n, [gen(1000 + i) for i in range(n)])
    return torch.tensor(res.token_ids)


def freqs(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).float() / len(tokens)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": 2**64}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": [1, 2]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {3: 101}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {-3: 1}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
])
def test_invalid_field_raises_with_param(kwargs, param):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**kwargs)
    err = info.value
    assert err.param == param
    assert param in str(err)
    assert isinstance(err, ValueError) and isinstance(err, InvalidRequest) and err.code == "invalid_request"


def test_valid_params_are_normalised():
    p = SamplingParams(max_tokens=0, temperature=0, top_p=1, top_k=-1, min_p=1, seed=-5, stop="END",
                       logit_bias={"7": 100, 8: -100}, logprobs=0, n=64, presence_penalty=-2,
                       frequency_penalty=2, repetition_penalty=3)
    assert p.stop == ["END"]
    assert p.logit_bias == {7: 100.0, 8: -100.0}
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.greedy and not SamplingParams().greedy


def test_check_vocab_rejects_out_of_range_ids():
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).check_vocab(10)
    with pytest.raises(SamplingError) as info:
        SamplingParams(logit_bias={10: 1.0}).check_vocab(10)
    assert info.value.param == "logit_bias"
    with pytest.raises(SamplingError) as info:
        SamplingParams(stop_token_ids=[3, 12]).check_vocab(10)
    assert info.value.param == "stop_token_ids"


def test_for_child_offsets_seed_and_sets_n_to_one():
    p = SamplingParams(seed=10, n=4, top_k=3, stop=["x"])
    kids = [p.for_child(i) for i in range(4)]
    assert [k.seed for k in kids] == [10, 11, 12, 13]
    assert all(k.n == 1 and k.top_k == 3 and k.stop == ["x"] for k in kids)
    assert p.n == 4 and p.seed == 10
    assert SamplingParams(n=3).for_child(2).seed is None
    top = SamplingParams(seed=2**64 - 1).for_child(1)  # wraps, still valid, same generator as seed 2**64
    assert top.seed == 0


def test_check_stop_token():
    p = SamplingParams(max_tokens=3, stop_token_ids=[5])
    assert check_stop_token(p, 1, 1, eos_token_ids=[2]) is None
    assert check_stop_token(p, 2, 1, eos_token_ids=[2]) == ("stop", None)
    assert check_stop_token(p, 5, 1, eos_token_ids=[2]) == ("stop", 5)
    assert check_stop_token(p, 1, 3, eos_token_ids=[2]) == ("length", None)
    ign = SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=[5])
    assert check_stop_token(ign, 2, 1, eos_token_ids=[2]) is None
    assert check_stop_token(ign, 5, 1, eos_token_ids=[2]) == ("stop", 5)


# ---------------------------------------------------------------- greedy and determinism

def test_greedy_equals_argmax_and_consumes_no_randomness():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    g = gen(3)
    state = g.get_state().clone()
    for extra in ({}, {"logprobs": 2}, {"top_k": 5, "top_p": 0.5}):  # fast path and full path
        params = [SamplingParams(temperature=0, seed=3, **extra)] * 6
        res = sample(logits, params, [g] * 6)
        assert isinstance(res, SampleResult)
        assert res.token_ids == logits.argmax(-1).tolist()
    assert torch.equal(g.get_state(), state)


def test_logits_are_not_modified():
    torch.manual_seed(1)
    logits = torch.randn(3, 20)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_k=3, presence_penalty=1, logit_bias={1: 5}, seed=i)
              for i in range(3)]
    sample(logits, params, [gen(i) for i in range(3)], [[1, 2], [3], []])
    assert torch.equal(logits, before)


def test_seeded_row_is_independent_of_its_batch():
    """A seeded row draws the same tokens alone and at any position among other rows."""
    torch.manual_seed(2)
    V, steps = 40, 60
    step_logits = [torch.randn(V) for _ in range(steps)]
    mine = SamplingParams(seed=1234, temperature=0.9, top_k=20, top_p=0.95)

    def run(position: int, batch: int) -> list[int]:
        others = [SamplingParams(seed=99 + j, temperature=1.3) if j % 3 == 0 else
                  SamplingParams(temperature=0.7, min_p=0.1) if j % 3 == 1 else
                  SamplingParams(temperature=0) for j in range(batch)]
        params = others[:position] + [mine] + others[position:]
        gens = [make_generator(p) for p in params]
        out = []
        for t, row in enumerate(step_logits):
            noise = torch.randn(batch + 1, V) * 3
            noise[position] = 0
            logits = row[None, :] + noise  # other rows see different logits each step
            out.append(sample(logits, params, gens).token_ids[position])
        return out

    alone = run(0, 0)
    assert len(set(alone)) > 5  # really sampling, not stuck on one token
    assert run(0, 3) == alone
    assert run(2, 4) == alone
    assert run(5, 5) == alone


def test_unseeded_rows_differ_and_seeded_rows_repeat():
    logits = torch.zeros(1, 1000)
    a = [sample(logits, [SamplingParams()], [make_generator(SamplingParams())]).token_ids[0] for _ in range(5)]
    assert len(set(a)) > 1
    b = [sample(logits, [SamplingParams(seed=5)], [make_generator(SamplingParams(seed=5))]).token_ids[0]
         for _ in range(5)]
    assert len(set(b)) == 1


# ---------------------------------------------------------------- truncation and temperature

def test_top_k_one_and_tiny_top_p_equal_greedy():
    torch.manual_seed(3)
    logits = torch.randn(16, 100) * 2
    greedy = logits.argmax(-1).tolist()
    for p in (SamplingParams(top_k=1, temperature=1.5), SamplingParams(top_p=1e-6, temperature=1.5)):
        res = sample(logits, [p] * 16, [gen(i) for i in range(16)])
        assert res.token_ids == greedy


@pytest.mark.parametrize("T", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_distribution(T):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    expected = torch.softmax(logits / T, dim=-1)
    got = freqs(draw_many(logits, SamplingParams(temperature=T), 5000), 6)
    assert (got - expected).abs().max() < 0.025, (got, expected)


def test_top_k_keeps_the_k_most_likely_renormalised():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    got = freqs(draw_many(logits, SamplingParams(top_k=2), 5000), 5)
    expected = torch.zeros(5)
    expected[[1, 3]] = torch.softmax(torch.tensor([3.0, 2.0]), dim=-1)
    assert (got - expected).abs().max() < 0.025, got


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # before-mass 0, .5, .8, .95: with p = 0.7 tokens 0 and 1 stay (0.5 < 0.7 <= 0.8).
    got = freqs(draw_many(probs.log(), SamplingParams(top_p=0.7), 5000), 4)
    expected = torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    assert got[2] == 0 and got[3] == 0
    assert (got - expected).abs().max() < 0.025, got


def test_min_p_filters_relative_to_the_top_token():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    # min_p 0.3: threshold 0.12 -> tokens 0, 1, 2 stay.
    got = freqs(draw_many(probs.log(), SamplingParams(min_p=0.3), 5000), 6)
    expected = torch.tensor([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8
    assert got[3:].sum() == 0
    assert (got - expected).abs().max() < 0.025, got


def test_masked_logits_are_never_drawn():
    logits = torch.full((8,), float("-inf"))
    logits[[2, 5]] = 0.0
    tokens = draw_many(logits, SamplingParams(temperature=1.7), 500)
    assert set(tokens.tolist()) == {2, 5}


# ---------------------------------------------------------------- penalties and bias

def reference_logits(logits: list[float], p: SamplingParams, output: list[int], prompt: list[int]) -> list[float]:
    """Hand-written, per-token reference: bias, then HF repetition penalty, then OpenAI penalties."""
    x = list(logits)
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def test_penalties_and_bias_match_reference_under_greedy():
    gen_cpu = torch.Generator().manual_seed(4)
    B, V = 200, 12
    logits = torch.randn(B, V, generator=gen_cpu) * 2
    params, outputs, prompts = [], [], []
    for i in range(B):
        r = torch.rand(4, generator=gen_cpu).tolist()
        params.append(SamplingParams(
            temperature=0, presence_penalty=4 * r[0] - 2, frequency_penalty=2 * r[1] - 1,
            repetition_penalty=0.5 + 2 * r[2],
            logit_bias={int(r[3] * V): 3.0} if i % 2 else {}))
        outputs.append(torch.randint(V, (i % 7,), generator=gen_cpu).tolist())
        prompts.append(torch.randint(V, (3,), generator=gen_cpu).tolist())
    res = sample(logits, params, [None] * B, outputs, prompts)
    expected = [max(range(V), key=ref.__getitem__) for ref in
                (reference_logits(logits[i].tolist(), params[i], outputs[i], prompts[i]) for i in range(B))]
    assert res.token_ids == expected
    assert res.token_ids != logits.argmax(-1).tolist()  # the penalties did change some choices


def test_penalties_shift_choices_in_the_expected_direction():
    logits = torch.tensor([[2.0, 1.9, 0.5]])
    greedy = SamplingParams(temperature=0)
    assert sample(logits, [greedy], [None], [[0]]).token_ids == [0]
    for kw in ({"presence_penalty": 0.5}, {"frequency_penalty": 0.15}, {"repetition_penalty": 1.1}):
        p = SamplingParams(temperature=0, **kw)
        assert sample(logits, [p], [None], [[0]], [[]]).token_ids == [1], kw
    # frequency scales with the count, presence does not
    assert sample(logits, [SamplingParams(temperature=0, frequency_penalty=0.04)], [None], [[0]]).token_ids == [0]
    assert sample(logits, [SamplingParams(temperature=0, frequency_penalty=0.04)], [None], [[0, 0, 0]]
                  ).token_ids == [1]
    # repetition penalty also sees the prompt; negative presence penalty encourages repeats
    assert sample(logits, [SamplingParams(temperature=0, repetition_penalty=1.1)], [None], [[]], [[0]]
                  ).token_ids == [1]
    assert sample(logits, [SamplingParams(temperature=0, presence_penalty=-0.5)], [None], [[1]]).token_ids == [1]


def test_logit_bias_forces_and_bans_tokens():
    logits = torch.zeros(20)
    tokens = draw_many(logits, SamplingParams(logit_bias={7: 100}), 200)
    assert set(tokens.tolist()) == {7}
    banned = draw_many(logits, SamplingParams(logit_bias={t: -100 for t in range(19)}), 200)
    assert set(banned.tolist()) == {19}


# ---------------------------------------------------------------- logprobs

def test_logprobs_equal_log_softmax_of_raw_logits():
    torch.manual_seed(5)
    logits = torch.randn(4, 30) * 3
    params = [SamplingParams(logprobs=5, temperature=0.3, presence_penalty=2, seed=1),
              SamplingParams(temperature=0),
              SamplingParams(logprobs=0, temperature=0, logit_bias={0: 50}),
              SamplingParams(logprobs=20, top_k=2, seed=2)]
    res = sample(logits, params, [gen(1), None, None, gen(2)], [[1, 2, 3], [], [], []])
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert res.logprobs[1] is None and res.top_logprobs[1] is None
    assert res.token_ids[2] == 0  # the bias moved the choice, the logprob stays raw
    for i in (0, 2, 3):
        tok = res.token_ids[i]
        assert math.isclose(res.logprobs[i], ref[i, tok].item(), abs_tol=1e-5)
        k = params[i].logprobs
        top = res.top_logprobs[i]
        assert len(top) == k
        want_ids = ref[i].argsort(descending=True)[:k].tolist()
        assert [t for t, _ in top] == want_ids
        for t, lp in top:
            assert math.isclose(lp, ref[i, t].item(), abs_tol=1e-5)


# ---------------------------------------------------------------- misuse

def test_bad_inputs_give_clear_errors():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="generator"):
        sample(logits, [SamplingParams(), SamplingParams()], [gen(0), None])
    with pytest.raises(ValueError, match="one per row"):
        sample(logits, [SamplingParams()], [gen(0)])
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        sample(torch.zeros(5), [SamplingParams()], [gen(0)])

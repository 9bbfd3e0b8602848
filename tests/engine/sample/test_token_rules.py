"""The Sampler's token rules (vLLM's extras: min_tokens, allowed_token_ids, bad_words) against a plain
reference: the same logits with the banned tokens set to -inf by a loop, then the same draw."""

import pytest
import torch

from engine.api.sampling_params import SamplingError, SamplingParams
from engine.core.output_processor import check_stop_token
from engine.sample.sampler import Sampler, make_generator

V = 32
sample = Sampler()


def reference_banned(p: SamplingParams, output: list[int]) -> set[int]:
    banned = set()
    if p.allowed_token_ids is not None:
        banned |= set(range(V)) - set(p.allowed_token_ids)
    if len(output) < p.min_tokens:
        banned |= set(p.stop_token_ids) | set(p.eos_token_ids)
    for w in p.bad_words_ids:
        if len(w) == 1 or (len(output) >= len(w) - 1 and output[len(output) - len(w) + 1:] == w[:-1]):
            banned.add(w[-1])
    return banned


ROWS = [
    (SamplingParams(max_tokens=8, temperature=0, min_tokens=3, stop_token_ids=[5], eos_token_ids=[7]), [1, 2]),
    (SamplingParams(max_tokens=8, temperature=0, min_tokens=2, eos_token_ids=[7]), [1, 2]),  # reached: no ban
    (SamplingParams(max_tokens=8, temperature=0.9, seed=3, allowed_token_ids=[4, 9, 30]), [1]),
    (SamplingParams(max_tokens=8, temperature=0, bad_words_ids=[[6], [1, 2, 8], [2, 3]]), [0, 1, 2]),
    (SamplingParams(max_tokens=8, temperature=0.7, seed=5, repetition_penalty=1.3,
                    bad_words_ids=[[11, 12]], min_tokens=4, eos_token_ids=[0]), [11]),
    (SamplingParams(max_tokens=8, temperature=0), [3]),  # a free row in the same batch is untouched
]


def test_token_rules_match_the_reference_and_leave_free_rows_alone():
    torch.manual_seed(0)
    logits = torch.randn(len(ROWS), V) * 3
    # make each banned token the favourite, so a rule that does not bite changes the token
    for i, (p, out) in enumerate(ROWS):
        for t in reference_banned(p, out):
            logits[i, t] = 50.0
    params = [p for p, _ in ROWS]
    outs = [o for _, o in ROWS]
    gens = [make_generator(p) if not p.greedy else None for p in params]
    got = sample(logits, params, gens, outs, [[] for _ in ROWS]).token_ids
    for i, (p, out) in enumerate(ROWS):
        banned = reference_banned(p, out)
        masked = logits[i:i + 1].clone()
        masked[0, list(banned)] = float("-inf")
        gen = make_generator(p) if not p.greedy else None
        ref_params = SamplingParams(max_tokens=8, temperature=p.temperature, seed=p.seed,
                                    repetition_penalty=p.repetition_penalty)
        want = sample(masked, [ref_params], [gen], [out], [[]]).token_ids[0]
        assert got[i] == want and got[i] not in banned, (i, got[i], want, banned)
    assert got[-1] == int(logits[-1].argmax())


def test_min_tokens_holds_back_the_stop_check_too():
    p = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=[5])
    assert check_stop_token(p, 5, 1, [7]) is None and check_stop_token(p, 7, 2, [7]) is None
    assert check_stop_token(p, 5, 3, [7]) == ("stop", 5) and check_stop_token(p, 7, 3, [7]) == ("stop", None)
    assert check_stop_token(SamplingParams(max_tokens=2, min_tokens=2), 1, 2, [7]) == ("length", None)


@pytest.mark.parametrize("kwargs, param", [
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"bad_words_ids": [[]]}, "bad_words"),
    ({"bad_words_ids": [[1]] * 129}, "bad_words"),
    ({"priority": 2**40}, "priority"),
])
def test_invalid_token_rules_raise_with_param(kwargs, param):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_token_ids_outside_the_vocabulary_are_refused():
    for kwargs, param in (({"allowed_token_ids": [V]}, "allowed_token_ids"), ({"bad_words_ids": [[1, V]]}, "bad_words")):
        with pytest.raises(SamplingError) as info:
            SamplingParams(**kwargs).check_vocab(V)
        assert info.value.param == param

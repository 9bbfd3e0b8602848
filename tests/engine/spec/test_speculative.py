"""Speculative decoding (engine/spec/decoder.py): model-free drafts verified in the normal step.

The oracle is the engine without speculation and the cacheless forward: greedy output must be token for
token the same, the cells must hold exactly each sequence's cached positions after every tick, and
nothing may leak. The whole engine suite also runs with `CELLSERVE_SPECULATIVE=ngram` forced on.
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
    run_requests,
    scripted_model,
    shared_tokenizer,
)
from tiny_models import tiny_model

from engine.api.sampling_params import SamplingParams
from engine.spec.lookup import lookup_draft

REPEATING = prompt(7, 1) * 5  # a history whose continuation prompt lookup can guess


def _run(engine, prompts, params):
    return run_requests(engine, prompts, params)


def test_lookup_draft_takes_the_most_recent_continuation_longest_match_first():
    history = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    assert lookup_draft(history, [], 3).tokens == [4, 5, 7]  # "2 3" last seen before "4 5 7"
    assert lookup_draft([5, 6, 7, 8], [], 3).tokens == []  # no earlier occurrence of any suffix
    assert lookup_draft([8, 1, 2], [[0, 1, 2, 6, 6, 6]], 2).tokens == [6, 6]  # from a sibling's history
    assert lookup_draft(history, [], 0).tokens == []
    assert lookup_draft(history, [], 3).matched == 2  # "9 1" before the source, "7 2 3" ends the history
    found = lookup_draft([7, 9, 1, 2, 3, 4, 6, 7, 9, 1, 2, 3, 4], [], 2)
    assert found.tokens == [6, 7] and found.matched == 6  # the 4-gram, and "7 9" before it agree too


def test_greedy_output_is_the_same_with_and_without_drafts(model):
    prompts = [REPEATING, prompt(20, 2), REPEATING[:13], prompt(5, 3) * 4]
    plain = _run(make_engine(model=model, speculative=None), prompts, greedy(40))
    engine = make_engine(model=model, speculative="ngram")
    spec = _run(engine, prompts, greedy(40))
    assert [o.tokens[0] for o in spec] == [o.tokens[0] for o in plain]
    assert spec[0].tokens[0] == greedy_oracle(model, REPEATING, 40)
    assert engine.speculative.accepted > 0 and engine.steps < 40 + len(prompts)


def test_bf16_greedy_output_is_the_same_with_and_without_drafts():
    """bf16 rounds coarsely: a drafted row that rounded differently from the one-row decode step would flip
    near-tied tokens of a random tiny model within a few dozen steps. Rows of a step up to INVARIANT_ROWS are
    computed as lone rows (engine/model/native/rows.py: needs AMX for bf16), so the outputs match; without AMX
    there is no such guarantee, and on these prompts the outputs match all the same (checked on an AMD EPYC)."""
    prompts = [REPEATING, prompt(5, 3) * 4, prompt(3, 4) * 6]
    outs = []
    for spec in (None, "ngram"):
        engine = make_engine(model=tiny_model("llama_gqa").to(torch.bfloat16), speculative=spec)
        outs.append([o.tokens[0] for o in _run(engine, prompts, greedy(48))])
    assert outs[1] == outs[0]
    assert engine.speculative.accepted > 20


def test_drafts_never_pass_max_tokens_and_free_every_cell(model):
    engine = make_engine(model=model, speculative="ngram")
    baseline = engine.free_cells()
    outs = _run(engine, [REPEATING, REPEATING[3:]], greedy(9))
    assert [len(o.tokens[0]) for o in outs] == [9, 9] and all(o.finish[0] == "length" for o in outs)
    engine.clear_prefix_cache()
    assert engine.cache.free_cells() == baseline


def test_a_stop_token_inside_an_accepted_draft_ends_the_choice_there():
    """A scripted model walks a cycle, so the draft guesses right; the stop token falls mid-draft."""
    tok = shared_tokenizer()
    cycle = list(range(10, 20))
    model = scripted_model(tok, {t: cycle[(i + 1) % len(cycle)] for i, t in enumerate(cycle)})
    engine = make_engine(model=model, tokenizer=tok, speculative="ngram")
    baseline = engine.free_cells()
    params = SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[17])
    out = _run(engine, [cycle * 3 + cycle[:2]], params)[0]
    assert out.tokens[0] == [12, 13, 14, 15, 16, 17] and out.finish[0] == "stop" and out.stop_reason[0] == 17
    assert engine.speculative.accepted >= 3
    engine.clear_prefix_cache()
    assert engine.cache.free_cells() == baseline


def test_a_persistent_sequence_continues_on_its_drafted_cells(model):
    plain, engine = make_engine(model=model, speculative=None), make_engine(model=model, speculative="ngram")
    results = []
    for e in (plain, engine):
        seq, _ = e.create_sequence(REPEATING)
        drain(e)
        first, second = Collector(), Collector()
        e.add_request("a", [], greedy(12), first, seq.seq_id)
        drain(e)
        e.add_request("b", REPEATING[:4], greedy(12), second, seq.seq_id)
        drain(e)
        check_cells_match_sequences(e)
        assert seq.n_cached == len(seq.token_ids) - 1  # idle: the last token stays uncached
        results.append((first.tokens[0], second.tokens[0]))
    assert results[0] == results[1]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=30, temperature=0.7, seed=3),
    SamplingParams(max_tokens=30, temperature=1.0, top_k=5, seed=11, frequency_penalty=0.5),
    SamplingParams(max_tokens=30, temperature=0, n=3),
    SamplingParams(max_tokens=30, temperature=0.5, n=2, seed=5),
], ids=["sampled", "sampled-topk-penalty", "greedy-n3", "sampled-n2"])
def test_seeded_and_n_choice_output_is_the_same_with_and_without_drafts(model, params):
    """A sampled row draws with the noise its next token would have used without drafts (its generator is
    rewound after verification): the same seed gives the same tokens, drafts or not."""
    prompts = [REPEATING, prompt(6, 9) * 4]
    plain = _run(make_engine(model=model, speculative=None), prompts, params)
    engine = make_engine(model=model, speculative="ngram")
    spec = _run(engine, prompts, params)
    assert [o.tokens for o in spec] == [o.tokens for o in plain]
    assert engine.speculative.drafted > 0


def test_auto_drafts_only_what_its_matches_pay_for(model):
    """Where drafted rows cost (here a fixed curve: 9 rows 2.9x one, as on the Q4_1 file), "auto" learns per
    match length how much of a lookup draft is kept and drafts only what pays: on prompts with nothing
    repeated (the matches are the model's own loops, short ones first) it drafts less than "ngram", which
    always drafts, and keeps a larger share of what it drafts. Both give the output without drafts."""
    prompts = [prompt(40, 3), prompt(30, 4)]
    plain = _run(make_engine(model=model, speculative="off"), prompts, greedy(60))
    drafted = {}
    for mode in ("auto", "ngram"):
        engine = make_engine(model=model, speculative=mode)
        for rows in range(1, 11):
            engine.speculative.costs.observe(rows, 4.5e-3 + 1.0e-3 * (rows - 1))
        engine.speculative.costs.observe = lambda rows, seconds: None  # the curve holds whatever this machine does
        assert [o.tokens for o in _run(engine, prompts, greedy(60))] == [o.tokens for o in plain]
        drafted[mode] = engine.speculative.drafted, engine.speculative.accepted
    (auto, auto_kept), (ngram, ngram_kept) = drafted["auto"], drafted["ngram"]
    assert 0 < auto < ngram and auto_kept / auto >= ngram_kept / ngram, drafted


def test_auto_does_not_draft_in_a_tick_that_prefills():
    """A prompt being prefilled makes the tick compute-bound: "auto" drafts only in all-decode ticks, so a
    newcomer's first token is not delayed by drafted rows; once it decodes too, drafting resumes."""
    tok = shared_tokenizer()
    cycle = list(range(10, 20))  # a scripted model walks the cycle, so every draft is kept
    model = scripted_model(tok, {t: cycle[(i + 1) % len(cycle)] for i, t in enumerate(cycle)})
    engine = make_engine(model=model, tokenizer=tok, speculative="auto")
    engine.add_request("copier", cycle * 3, greedy(40), Collector())
    while engine.speculative.drafted == 0:  # decoding, and drafting from its history
        engine.step()
    copier = engine.scheduler.running[0]
    engine.add_request("newcomer", cycle[3:] + cycle, greedy(30), Collector())
    assert lookup_draft(copier.token_ids, [], 4).tokens  # a draft is there to take  # a draft is there to take
    before = engine.speculative.drafted
    engine.step()  # the newcomer's prefill rides this tick
    assert engine.speculative.drafted == before
    drain(engine)
    assert engine.speculative.drafted > before  # both decoding: drafts again
    check_cells_match_sequences(engine)


def test_a_predicted_output_drafts_what_it_predicts_and_changes_nothing(model):
    """OpenAI's `prediction`: the right prediction is kept in long drafts (few steps); a wrong one, or one
    the output leaves, is rejected and the output is still token for token the plain greedy one."""
    p = prompt(20, 2)  # no repetition: prompt lookup alone finds nothing to copy
    want = greedy_oracle(model, p, 24)
    plain = make_engine(model=model, speculative="off")
    assert _run(plain, [p], greedy(24))[0].tokens[0] == want
    for predicted, kept in ((want, True), (want[:10] + [t ^ 1 for t in want[10:]], True), ([3] * 24, False)):
        engine = make_engine(model=model, speculative="ngram")
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prediction_ids=predicted)
        assert _run(engine, [p], params)[0].tokens[0] == want
        assert (engine.speculative.accepted >= 9) == kept, (predicted, engine.speculative.accepted)
    right = make_engine(model=model, speculative="ngram")
    _run(right, [p], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prediction_ids=want))
    assert right.steps <= 24 // 4 + 3  # k=4 drafts, each kept whole (+ the prefill)


def test_a_prediction_is_validated_like_any_token_list():
    with pytest.raises(ValueError, match="prediction"):
        SamplingParams(prediction_ids=["a"])
    with pytest.raises(ValueError, match="prediction"):
        SamplingParams(prediction_ids=[0] * (1 << 16))


def test_a_regenerate_fork_drafts_its_parents_old_reply(model):
    """A chat page's regenerate forks a conversation where its last reply began: a greedy regenerate
    repeats that reply, so the parent's tokens past the fork point are drafted whole (few steps)."""
    p = prompt(20, 2)  # nothing to copy from the prompt itself
    engine = make_engine(model=model, speculative="ngram")
    seq, _ = engine.create_sequence(p)
    drain(engine)
    first = Collector()
    engine.add_request("a", [], greedy(24), first, seq.seq_id)
    drain(engine)
    child = engine.fork(seq.seq_id, len(p))
    accepted, steps = engine.speculative.accepted, engine.steps
    again = Collector()
    engine.add_request("b", [], greedy(24), again, child.seq_id)
    drain(engine)
    check_cells_match_sequences(engine)
    assert again.tokens[0] == first.tokens[0] == greedy_oracle(model, p, 24)
    assert engine.speculative.accepted - accepted >= 18 and engine.steps - steps <= 24 // 4 + 2

"""StepCosts (engine/spec/costs.py): the draft length "auto" allows from measured step costs and acceptance."""

import pytest
from engine_support import greedy, make_engine, prompt, run_requests, scripted_model, shared_tokenizer

from engine.api.sampling_params import SamplingParams
from engine.spec.costs import MatchAcceptance, StepCosts, calibrated, geometric, kept_rate

# one sequence's decode steps at 1, 2, 3, 5 and 9 rows, ms, one thread (the Q4_1 file's integer row kernel;
# bf16 on AMX), measured with a 500-token context
Q4_1 = {1: 15.3, 2: 20.1, 3: 25.6, 5: 35.2, 9: 61.7}
BF16_AMX = {1: 23.6, 2: 28.5, 3: 30.5, 5: 35.5, 9: 48.0}


def _costs(table: dict[int, float]) -> StepCosts:
    costs = StepCosts()
    for rows, ms in table.items():
        costs.observe(rows, ms / 1e3)
    return costs


def test_costs_interpolate_and_stay_optimistic_past_what_was_seen():
    costs = _costs({1: 10.0, 5: 30.0})
    assert costs.cost(3) == pytest.approx(0.020) and costs.cost(9) == pytest.approx(0.030)
    assert StepCosts().cost(4) is None and _costs({5: 30.0}).cost(2) == pytest.approx(0.030)
    costs.observe(5, 0.040)  # an EMA: the newest step moves it a fifth of the way
    assert costs.cost(5) == pytest.approx(0.032)


def test_expected_tokens_and_acceptance():
    def expected_tokens(a, length):  # tokens a step yields: the one it always makes plus S(1) + ... + S(L)
        return 1 + sum(geometric(a, length))

    assert expected_tokens(1.0, 8) == 9 and expected_tokens(0.0, 8) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert kept_rate(4, 1) == pytest.approx(0.8) and kept_rate(0, 0) == 0


def test_the_best_length_follows_what_rows_cost():
    def best(table, a, shortest=1):
        return _costs(table).best_length(1, geometric(a, 8), 8, shortest)

    assert best(Q4_1, 0.85) == 4  # dear rows: 4 tokens pay best
    assert best(BF16_AMX, 0.85) == 6  # cheaper rows: longer drafts
    assert best(BF16_AMX, 0.99) == 8 and best(Q4_1, 0.99) == 7
    assert best(Q4_1, 0.3) == 1  # drafts that mostly miss: one token, or none where none is allowed
    assert best(Q4_1, 0.3, shortest=0) == 0 and best(BF16_AMX, 0.3, shortest=0) == 1
    assert StepCosts().best_length(1, geometric(0.5, 8), 8) == 8  # nothing measured yet: try the longest
    # any survival curve, not only a geometric one: kept whole or not at all
    assert _costs(Q4_1).best_length(1, [0.9] * 8, 8, 0) == 8 and _costs(Q4_1).best_length(1, [0.1] * 8, 8, 0) == 0


def test_a_drafted_tokens_own_cost_shortens_the_draft():
    """A draft model's token costs a forward of its own (`per_token`): a longer draft must pay for those too."""
    kept = geometric(0.9, 8)
    free = _costs(BF16_AMX).best_length(1, kept, 8)
    dear = _costs(BF16_AMX).best_length(1, kept, 8, per_token=5e-3)
    assert free == 8 and 1 <= dear < free
    assert _costs(BF16_AMX).rate(1, kept, 0) == pytest.approx(1 / 23.6e-3)
    assert _costs(BF16_AMX).rate(1, kept, 2, per_token=1e-3) == pytest.approx((1 + 0.9 + 0.81) / (30.5e-3 + 2e-3))


def test_auto_times_an_undrafted_tick_before_it_drafts(model):
    """Below the fewest rows timed a step is taken to cost what that one did, so a draft would look free: a
    fresh "auto" engine decodes its first tick without drafts (timing it), then drafts."""
    tok = shared_tokenizer()
    cycle = list(range(10, 20))
    walker = scripted_model(tok, {t: cycle[(i + 1) % len(cycle)] for i, t in enumerate(cycle)})
    engine = make_engine(model=walker, tokenizer=tok, speculative="auto")
    engine.add_request("r", cycle * 3, SamplingParams(max_tokens=20, temperature=0), lambda out: None)
    engine.step()  # the prefill (and its first token)
    engine.step()
    assert not engine.speculative.drafted and list(engine.speculative.costs.seconds) == [1]
    engine.step()
    assert engine.speculative.drafted > 0  # a 1-row tick is timed: lookups draft now


def test_match_acceptance_learns_per_match_length_and_position():
    m = MatchAcceptance(8)
    assert m.survival(3, 2) == pytest.approx([0.7, 0.7 * 0.85])  # the prior (measured): 3-token matches
    assert m.survival(1, 1)[0] < m.survival(8, 1)[0] < m.survival(16, 1)[0]  # longer matches are kept more
    for _ in range(200):
        m.observe(1, 8, 0)  # 1-token matches: the first token missed
        m.observe(16, 8, 8)  # long matches: kept whole
        m.observe(4, 8, 2)  # 4-token matches: two kept, the third missed (positions 4-8 not tried)
    assert m.survival(1, 1)[0] < 0.02 and m.survival(20, 8)[-1] > 0.9  # 20 counts with 16 (the last bucket)
    four = m.survival(5, 8)  # 4 and 5 share a bucket
    assert four[1] > 0.95 and four[2] < 0.02 and m.tried[m.bucket(4)][3] == pytest.approx(2.0)
    m.tried[0][0] = 1001.0
    m.observe(1, 8, 0)  # past the cap a bucket's counts halve first: recent drafts weigh most
    assert m.tried[0][0] == pytest.approx(501.5)


def test_auto_learns_step_costs_and_caps_drafts_by_them(model):
    """A scripted model walks a cycle, so "auto" drafts and its drafts are kept: both one-row decode steps and
    verification steps get timed. Then, with a cost curve given, the room a sequence gets follows it."""
    tok = shared_tokenizer()
    cycle = list(range(10, 20))
    walker = scripted_model(tok, {t: cycle[(i + 1) % len(cycle)] for i, t in enumerate(cycle)})
    engine = make_engine(model=walker, tokenizer=tok, speculative="auto")
    run_requests(engine, [cycle * 3], greedy(24))
    assert engine.speculative.accepted > 0
    seen = engine.speculative.costs.seconds  # decode steps: 1 row, or 1 + a draft of at most k = 8 tokens
    assert seen and set(seen) <= set(range(1, 10)) and max(seen) > 1
    engine = make_engine(model=model, speculative="auto")
    engine.speculative.costs = _costs(Q4_1)
    engine.add_request("r", prompt(7, 2) * 5, SamplingParams(max_tokens=30, temperature=0), lambda out: None)
    engine.step()  # the prefill
    seq = engine.scheduler.running[0]
    state = engine.speculative.state(seq)
    state.kept, state.missed = 8.5, 1.5  # 85% kept
    k = engine.speculative.k
    engine.speculative.n_running = len(engine.scheduler.queues().running)  # what `propose` reads in a tick: 1
    assert engine.speculative._paced(seq, k) == 4
    engine.speculative.costs = _costs(BF16_AMX)
    assert engine.speculative._paced(seq, k) == 6
    state.kept, state.missed = 99, 1
    assert engine.speculative._paced(seq, k) == k


def test_a_sequences_own_record_scales_its_short_match_drafts():
    kept = [0.6, 0.5, 0.4]
    assert calibrated(kept, 0.0, 0.0) == kept  # nothing drafted yet: the engine-wide rates
    assert calibrated(kept, 4.0, 4.0) == pytest.approx(kept)  # kept as many as expected
    assert calibrated(kept, 9.0, 0.0) == pytest.approx([k / 10 for k in kept])  # none of 9 expected kept
    assert calibrated(kept, 1.0, 9.0) == [1.0, 1.0, 1.0]  # better than expected: capped at certainty


def test_auto_stops_drafting_short_matches_a_sequence_keeps_missing(model, monkeypatch):
    """An answer that paraphrases: its history's short n-grams were followed by other tokens before, so its
    lookup drafts miss, while the engine-wide rates (here: 990 of 1000 kept) still expect them kept. The
    sequence's own record stops them; without it (SHORT_MATCH 0) they go on. Same output both ways."""
    tok = shared_tokenizer()
    cycle = list(range(10, 20))
    walker = scripted_model(tok, {t: cycle[(i + 1) % len(cycle)] for i, t in enumerate(cycle)})
    shuffled = [10, 15, 11, 16, 12, 17, 13, 18, 14, 19]  # each token followed by another than the model's

    def drafted(short_match: int):
        monkeypatch.setattr("engine.spec.decoder.SHORT_MATCH", short_match)
        engine = make_engine(model=walker, tokenizer=tok, speculative="auto")
        engine.speculative.costs = _costs(Q4_1)
        monkeypatch.setattr(engine.speculative.costs, "observe", lambda rows, seconds: None)  # Q4_1's, kept
        matches = engine.speculative.matches
        matches.tried = [[1000.0] * len(row) for row in matches.tried]
        matches.kept = [[990.0] * len(row) for row in matches.kept]
        outs = run_requests(engine, [shuffled], greedy(9))  # 10 .. 18: no token twice, no draft can be kept
        return engine.speculative.drafted, engine.speculative.accepted, outs[0].tokens

    with_record, kept_with, out_with = drafted(4)
    without, kept_without, out_without = drafted(0)
    assert out_with == out_without and kept_with == kept_without == 0
    assert with_record <= 8 and without >= 3 * with_record, (with_record, without)  # one draft, then none

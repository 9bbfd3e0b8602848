"""A draft model for speculative decoding (engine/spec/draft_model.py): a tiny seeded target with a tiny seeded
draft of the same vocabulary. Oracles: the engine without speculation and the cacheless greedy forward; for
sampled requests, the target's own next-token distributions computed without the engine (chi-square)."""

import pytest
import torch
from engine_support import (
    Collector,
    check_cells_match_sequences,
    drain,
    greedy,
    greedy_oracle,
    prompt,
    run_requests,
)
from tiny_models import full_logits, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from engine.api.args import EngineArgs
from engine.api.errors import ModelSourceError
from engine.api.sampling_params import SamplingParams
from engine.core.engine import Engine
from engine.model.runner import ModelRunner
from engine.spec.costs import MatchAcceptance, StepCosts

N_CELLS = 512


def _engine(target, draft=None, n_cells=N_CELLS, **config) -> Engine:
    runner = ModelRunner(target, n_cells=n_cells)
    draft_runner = ModelRunner(draft, n_cells=n_cells) if draft is not None else None
    return Engine(runner, EngineArgs(**config), draft_runner)


def _run(engine, prompts, params):
    return run_requests(engine, prompts, params, check=_check_both_pools)


def _check_both_pools(engine: Engine) -> None:
    check_cells_match_sequences(engine)
    if engine.speculative is not None and engine.speculative.drafter is not None:
        check_draft_cells(engine)


def check_draft_cells(engine: Engine) -> None:
    """Between ticks the draft pool holds, per slot, exactly positions [0, held) with held <= the target's
    n_cached, and nothing for slots no sequence holds."""
    drafter = engine.speculative.drafter
    for slot in range(drafter.cache.max_seqs):
        seq = engine.scheduler.holders.get(slot)
        held = drafter.cache.seq_positions(slot).tolist()
        assert held == list(range(drafter.held[slot])), (slot, held, drafter.held[slot])
        assert drafter.held[slot] <= (seq.n_cached if seq is not None else 0), (slot, drafter.held[slot])


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama_gqa", seed=0)


@pytest.fixture(scope="module")
def draft():
    return tiny_model("llama_gqa", seed=1)


PROMPTS = [prompt(20, 2), prompt(7, 1) * 3, prompt(11, 5), prompt(3, 8)]


@pytest.mark.parametrize("mode", ["ngram", "auto"])
def test_greedy_output_is_the_output_without_drafts_and_the_oracles(target, draft, mode):
    plain = _run(_engine(target, speculative="off"), PROMPTS, greedy(24))
    engine = _engine(target, draft, speculative=mode)
    spec = _run(engine, PROMPTS, greedy(24))
    assert [o.tokens for o in spec] == [o.tokens for o in plain]
    assert spec[0].tokens[0] == greedy_oracle(target, PROMPTS[0], 24)
    assert engine.speculative.drafted > 0


def test_a_draft_with_the_target_weights_is_accepted_whole(target):
    """Greedy and sampled alike (q == p: every draft token passes min(1, p/q) = 1), the draft model's drafts
    are kept whole (n-gram drafts, tried first, miss as they do without a model)."""
    for params in (greedy(40), SamplingParams(max_tokens=40, temperature=0.8, seed=4, ignore_eos=True)):
        engine = _engine(target, target, speculative="ngram")
        out = _run(engine, [prompt(20, 2)], params)[0]
        drafter = engine.speculative.drafter
        assert len(out.tokens[0]) == 40
        assert drafter.accepted == drafter.drafted >= 8, (drafter.accepted, drafter.drafted)


def test_seeded_sampled_requests_are_reproducible(target, draft):
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=7, top_k=20, frequency_penalty=0.3, ignore_eos=True)
    runs, engines = [], [_engine(target, draft, speculative="ngram") for _ in range(2)]
    for engine in engines:
        runs.append([o.tokens for o in _run(engine, PROMPTS, params)])
    assert runs[0] == runs[1]
    assert all(len(t[0]) == 30 for t in runs[0])
    assert engines[0].speculative.drafter.drafted > 0


def _peaked_model(seed: int, vocab: int = 8) -> LlamaForCausalLM:
    """A tiny Llama over `vocab` tokens whose next-token distributions are far from uniform."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.set_attn_implementation("sdpa")
    return model.eval()


def _second_and_third(model, ids: list[int], temperature: float, vocab: int) -> torch.Tensor:
    """p(t2, t3 | ids) at `temperature` (t1 summed out), from cacheless forwards (the oracle)."""
    def probs(hist):
        return torch.softmax(full_logits(model, hist)[-1].double() / temperature, -1)

    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t1, p1 in enumerate(probs(ids)):
        p2 = probs(ids + [t1])
        joint += p1 * p2[:, None] * torch.stack([probs(ids + [t1, t2]) for t2 in range(vocab)])
    return joint


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of `counts` against `probs` (cells expecting < 5 pooled into one)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_sampled_output_follows_the_target_distribution_not_the_drafts():
    """3,000 seeded samples over an 8-token vocabulary: the first token comes from the prefill, the next two
    are drafted by the draft model (the prompt is one token: no n-gram, unless the first token repeats it) and
    verified; the kept or resampled tokens (t2, t3) must be distributed as the target's p(t2, t3), not as the
    draft's q (the same test rejects q)."""
    vocab, temperature, n = 8, 1.0, 3000
    target, draft = _peaked_model(0), _peaked_model(1)
    ids = [7]
    p, q = (_second_and_third(m, ids, temperature, vocab) for m in (target, draft))
    assert 0.5 * (p - q).abs().sum() > 0.2  # the draft is a poor guess: many drafts are refused
    engine = _engine(target, draft, n_cells=4096, speculative="ngram", num_speculative_tokens=2,
                     max_num_seqs=256, prefix_caching=False, max_queue=1 << 20)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    outs = []
    for i in range(n):
        out = Collector()
        params = SamplingParams(max_tokens=4, temperature=temperature, seed=i, ignore_eos=True)
        engine.add_request(f"r{i}", ids, params, out)
        outs.append(out)
    drain(engine, max_steps=100_000)
    for out in outs:
        counts[out.tokens[0][1], out.tokens[0][2]] += 1
    drafter = engine.speculative.drafter
    assert drafter.drafted >= n and 0.1 * drafter.drafted < drafter.accepted < 0.9 * drafter.drafted
    assert _chi2_pvalue(counts.flatten(), p.flatten()) > 1e-3
    assert _chi2_pvalue(counts.flatten(), q.flatten()) < 1e-6


def test_forks_and_cancels_leave_no_cell_in_either_pool(target, draft):
    engine = _engine(target, draft, speculative="ngram")
    drafter = engine.speculative.drafter
    seq, _ = engine.create_sequence(prompt(30, 3))
    drain(engine)
    engine.add_request("a", [], greedy(12), Collector(), seq.seq_id)
    drain(engine)
    forks = [engine.fork(seq.seq_id, 30), engine.fork(seq.seq_id)]
    for f in forks:  # a fork shares the parent's draft cells too (no copy, no re-prefill by the draft)
        assert drafter.held[f.slot] > 0 and drafter.cache.shared_cells(f.slot) == drafter.held[f.slot]
    check_draft_cells(engine)
    for i, f in enumerate(forks):
        engine.add_request(f"f{i}", [], SamplingParams(max_tokens=16, temperature=0.7, seed=i), Collector(), f.seq_id)
    engine.add_request("plain", prompt(12, 4), greedy(200), Collector())
    for _ in range(4):
        engine.step()
        check_cells_match_sequences(engine)
        check_draft_cells(engine)
    assert drafter.cache.used_cells() > 0
    engine.cancel("plain")
    engine.delete(forks[0].seq_id)  # generating: cancelled, then deleted
    check_draft_cells(engine)
    drain(engine)
    check_draft_cells(engine)
    for s in [seq, forks[1]]:
        engine.delete(s.seq_id)
    engine.clear_prefix_cache()
    assert engine.cache.free_cells() == engine.cache.n_cells
    assert drafter.cache.free_cells() == drafter.cache.n_cells
    assert engine.speculative.drafted > 0


def test_a_draft_of_another_vocabulary_is_refused(target):
    other = tiny_model("llama_gqa", seed=1)
    other.resize_token_embeddings(150)
    with pytest.raises(ModelSourceError, match="vocabulary of 150 tokens.*target's tokenizer"):
        _engine(target, other, speculative="auto")
    with pytest.raises(ValueError, match="speculative"):
        EngineArgs(draft_model="x", speculative="off")


def test_usage_counts_the_draft_models_tokens(target, draft):
    """Usage: the draft model's kept and refused tokens, as the n-gram path counts them."""
    for model, some_refused in ((target, False), (draft, True)):
        engine = _engine(target, model, speculative="auto")
        out = _run(engine, [prompt(20, 2)], greedy(20))[0]
        last, spec = out.deltas[-1], engine.speculative
        assert last.finished and len(out.tokens[0]) == 20
        assert (last.accepted_draft_tokens, last.accepted_draft_tokens + last.rejected_draft_tokens) == (
            spec.accepted, spec.drafted)
        drafter = spec.drafter
        assert drafter.drafted > 0 and (drafter.accepted < drafter.drafted) == some_refused
        assert spec.accepted >= drafter.accepted and spec.drafted >= drafter.drafted  # n-gram drafts besides


def test_auto_prefers_the_model_where_it_pays_more_than_a_lookup(target):
    """Under "auto" a lookup draft behind a short match (kept seldom) gives way to the draft model when the
    model's own record and its measured cost a token promise more tokens a second; a long match's lookup
    (kept almost whole, and free to make) stays. The model's steps are timed (`token_seconds`)."""
    engine = _engine(target, target, speculative="auto")
    spec = engine.speculative
    _run(engine, [prompt(20, 2)], greedy(30))
    assert spec.drafter.token_seconds > 0 and spec.drafter.drafted > 0
    spec.costs = StepCosts()  # the curve below alone: the run above timed steps on a machine of any load
    for rows in range(1, 10):  # the Q4_1 file's curve: 9 rows ~2.4x one
        spec.costs.observe(rows, 4.5e-3 + 1.3e-3 * (rows - 1))
    spec.drafter.token_seconds = 1.0e-3
    spec.matches = MatchAcceptance(spec.k)  # the measured priors, not what the run above taught it
    engine.add_request("r", prompt(9, 3) * 3, greedy(20), lambda out: None)
    engine.step()  # the prefill
    seq = engine.scheduler.running[0]
    state = spec.state(seq)
    state.kept, state.missed = 9.0, 1.0  # its model drafts: 90% kept
    spec.n_running = len(engine.scheduler.queues().running)  # what `propose` reads in a tick: 1
    state.tokens, state.match = list(range(10, 18)), 1  # a 1-token match: ~30% of its first token kept
    assert spec._model_pays_more(seq, 8)
    state.match = 16  # a 16-token match: 98%
    assert not spec._model_pays_more(seq, 8)
    spec.drafter.token_seconds = 50e-3  # a draft model dearer than the target: never worth it
    state.match = 1
    assert not spec._model_pays_more(seq, 8)

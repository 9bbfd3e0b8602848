"""Qwen3 and Gemma 3 (tiny, fp32) on the native forward through the whole engine: greedy output with speculative
drafts (their rows verified in one step) is token for token the output without them and the cacheless oracle's,
with prefix sharing (a second request over the same prompt reuses its cells) and the cells matching each
sequence after the run; Gemma's prompts are longer than its local window of 4."""

import pytest
from engine_support import greedy, greedy_oracle, make_engine, prompt, run_requests
from tiny_models import tiny_model

REPEATING = prompt(7, 1) * 5  # a history whose continuation prompt lookup can guess


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_greedy_with_drafts_and_shared_prefixes_is_the_oracles(name):
    model = tiny_model(name)
    prompts = [REPEATING, prompt(20, 2), prompt(5, 3) * 4]
    plain = make_engine(model=model, speculative=None)
    assert plain.runner.native is not None
    want = [o.tokens[0] for o in run_requests(plain, prompts, greedy(24))]
    engine = make_engine(model=model, speculative="ngram")
    got = [o.tokens[0] for o in run_requests(engine, prompts, greedy(24))]
    assert got == want
    assert got[0] == greedy_oracle(model, REPEATING, 24) and got[2] == greedy_oracle(model, prompts[2], 24)
    assert engine.speculative.accepted > 0
    # the same prompt again, and one extending it: their prompts' cells come from the prefix cache
    longer = REPEATING + prompt(6, 9)
    again = run_requests(engine, [REPEATING, longer], greedy(12), tag="again")
    assert all(o.deltas[-1].cached_tokens >= len(REPEATING) - 1 for o in again)
    assert again[0].tokens[0] == want[0][:12] and again[1].tokens[0] == greedy_oracle(model, longer, 12)

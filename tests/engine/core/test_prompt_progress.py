"""`SamplingParams.report_progress` (llama.cpp's `return_progress`): the engine sends an output at admission (what
the prefix cache held) and one after each prompt chunk it ran, counting the prompt tokens with cells, in step
order; the tokens are those of the same request without it; n > 1 reports once (choice 0); a request that did
not ask gets no such output."""

import dataclasses

from engine_support import Collector, drain, greedy, greedy_oracle, make_engine, prompt

CHUNK = 8


def _progress(got: Collector) -> list:
    return [d.prompt_progress for d in got.deltas if d.prompt_progress is not None]


def test_progress_follows_the_prefill_chunks(model):
    engine = make_engine(model=model, n_cells=512, max_num_batched_tokens=CHUNK)
    ids = prompt(30, seed=3)
    got = Collector()
    engine.add_request("a", ids, dataclasses.replace(greedy(4), report_progress=True), got)
    drain(engine)
    progress = _progress(got)
    assert [p.processed for p in progress] == [0, 8, 16, 24, 30]
    assert all(p.total == 30 and p.cached == 0 for p in progress)
    assert [p.at for p in progress] == sorted(p.at for p in progress)
    timing = got.deltas[-1].timing
    assert timing.prompt_started <= progress[0].at and progress[-1].at <= timing.first_token
    assert all(not d.outputs for d in got.deltas if d.prompt_progress is not None)  # progress only, no token
    assert got.tokens[0] == greedy_oracle(model, ids, 4)


def test_a_cached_prefix_is_reported_first_and_only_the_rest_is_prefilled(model):
    engine = make_engine(model=model, n_cells=512, max_num_batched_tokens=CHUNK)
    ids = prompt(40, seed=4)
    first = Collector()
    engine.add_request("a", ids, greedy(2), first)
    drain(engine)
    assert not _progress(first)  # not asked: no progress output
    again = Collector()
    engine.add_request("b", ids, dataclasses.replace(greedy(2, n=2), report_progress=True), again)
    drain(engine)
    progress = _progress(again)
    cached = again.deltas[-1].cached_tokens
    assert cached > 0 and progress[0].processed == progress[0].cached == cached
    assert progress[-1].processed == 40 and len(progress) == 1 + -(-(40 - cached) // CHUNK)
    assert again.tokens[0] == again.tokens[1] == greedy_oracle(model, ids, 2)

"""While n sequences decode, a tick carries at most max(`prefill_while_decoding`, n, backlog /
`prefill_backlog_ticks`) prefill tokens, so a long prompt cannot stall every stream for one long forward
and a queue of long prompts still drains in a bounded number of ticks; alone, a prompt gets the whole
budget. Outputs stay exact either way (the prompt just takes more ticks)."""

from engine_support import Collector, drain, greedy, greedy_oracle, make_engine, prompt


def _step_sizes(engine) -> list[int]:
    sizes = []
    forward = engine.runner.forward_hidden

    def spy(step):
        sizes.append(len(step.tokens))
        return forward(step)

    engine.runner.forward_hidden = spy
    return sizes


def test_prefill_is_capped_while_decoding_and_whole_when_alone():
    # 100 tokens of backlog / 8 < 32: the floor decides
    engine = make_engine(n_cells=1024, max_num_batched_tokens=512, prefill_while_decoding=32, prefill_backlog_ticks=8,
                         speculative=None)  # exact step sizes: no drafts riding along
    sizes = _step_sizes(engine)
    a, b = Collector(), Collector()
    pa, pb = prompt(150, 1), prompt(100, 2)
    engine.add_request("a", pa, greedy(12), a)
    engine.step()
    assert sizes == [150]  # nothing decodes yet: the whole prompt in one tick
    engine.add_request("b", pb, greedy(4), b)
    drain(engine)
    assert sizes[1:5] == [1 + 32] * 3 + [1 + 4]  # a's decode + 32 of b's 100 prompt tokens per tick
    assert a.tokens[0] == greedy_oracle(engine.runner.model, pa, 12)
    assert b.tokens[0] == greedy_oracle(engine.runner.model, pb, 4)


def test_a_long_backlog_raises_the_cap_to_drain_it_within_the_set_ticks():
    engine = make_engine(n_cells=2048, max_num_batched_tokens=1024, prefill_while_decoding=32, prefill_backlog_ticks=4,
                         speculative=None)  # exact step sizes: no drafts riding along
    sizes = _step_sizes(engine)
    a, b, c = Collector(), Collector(), Collector()
    pa, pb, pc = prompt(20, 1), prompt(200, 2), prompt(40, 3)
    engine.add_request("a", pa, greedy(12), a)
    engine.step()
    engine.add_request("b", pb, greedy(3), b)
    engine.add_request("c", pc, greedy(3), c)
    drain(engine)
    # backlog 240 -> 60 tokens beside a's decode, then 180 -> 45, 135 -> 34, then the floor of 32
    assert sizes[1:5] == [1 + 60, 1 + 45, 1 + 34, 1 + 32]
    for col, p, n in ((a, pa, 12), (b, pb, 3), (c, pc, 3)):
        assert col.tokens[0] == greedy_oracle(engine.runner.model, p, n)

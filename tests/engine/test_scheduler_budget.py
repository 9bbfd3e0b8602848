"""While n sequences decode, a tick carries at most max(`prefill_while_decoding`, n) prefill tokens, so a
long prompt cannot stall every stream for one long forward; alone, a prompt gets the whole budget.
Outputs stay exact either way (the prompt just takes more ticks)."""

from engine_support import Collector, drain, greedy, greedy_oracle, make_engine, prompt


def _step_sizes(engine) -> list[int]:
    sizes = []
    forward = engine.runner.forward

    def spy(tokens, *args):
        sizes.append(len(tokens))
        return forward(tokens, *args)

    engine.runner.forward = spy
    return sizes


def test_prefill_is_capped_while_decoding_and_whole_when_alone():
    engine = make_engine(n_cells=1024, max_num_batched_tokens=512)
    engine.scheduler.prefill_while_decoding = 32
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

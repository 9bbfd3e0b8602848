"""Embedding requests as rows of the flat step (engine/core/embedding.py): their prompt rows run in the same
forwards as generation's decodes and prefills, the runner hands back their final hidden states pooled (last,
mean, cls) instead of sampling them, and their cells go at once (or stay as a cached prefix).

Checked against a direct transformers forward (the oracle) and against the same embeddings made alone: the
vectors made beside generation equal those made alone (same chunks: bitwise; other chunkings: float32
rounding), and the greedy tokens of generation are the same with and without embeddings interleaved."""

import pytest
import torch
from engine_support import Collector, drain, greedy, make_engine, prompt

from engine.api.errors import InvalidRequest, PromptTooLong
from engine.core.embedding import vector_of

PROMPTS = [prompt(23, seed=1), prompt(9, seed=2), prompt(40, seed=3)]
GEN = [prompt(12, seed=10), prompt(30, seed=11)]


def oracle(model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    pooled = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
    return torch.nn.functional.normalize(pooled.float(), dim=0)


def generate(engine, embed_at: int | None, pooling: str = "last") -> tuple[list[list[int]], dict, int]:
    """Greedy generation of GEN (24 tokens each); with `embed_at`, PROMPTS are submitted as embeddings after that
    many ticks. Returns the tokens, {prompt index: vector}, and how many ticks ran embedding and generation rows
    together."""
    gens = [Collector() for _ in GEN]
    for i, (ids, got) in enumerate(zip(GEN, gens)):
        engine.add_request(f"g{i}", ids, greedy(24), got)
    outs: dict[int, object] = {}
    mixed = ticks = 0
    while engine.has_unfinished():
        if ticks == embed_at:
            for i, ids in enumerate(PROMPTS):
                engine.add_embedding(f"e{i}", ids, pooling, lambda out, i=i: outs.__setitem__(i, out))
        before = sum(len(d.deltas) for d in gens), len(outs)
        embedding_in_flight = any(r.pooling for r in engine.requests.values())
        engine.step()
        ticks += 1
        mixed += embedding_in_flight and sum(len(d.deltas) for d in gens) > before[0]
    vectors = {i: vector_of(out) for i, out in outs.items()}
    return [got.tokens[0] for got in gens], vectors, mixed


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_beside_generation_equal_alone_and_the_oracle(model, pooling):
    alone = make_engine(model=model, max_num_batched_tokens=16, prefix_caching=False)
    want = alone.embed(PROMPTS, pooling)
    for ids, vec in zip(PROMPTS, want):
        assert torch.allclose(torch.tensor(vec), oracle(model, ids, pooling), atol=1e-5)
    engine = make_engine(model=model, max_num_batched_tokens=16, prefix_caching=False)
    tokens_plain, _, _ = generate(make_engine(model=model, max_num_batched_tokens=16, prefix_caching=False), None)
    tokens, got, mixed = generate(engine, embed_at=2, pooling=pooling)
    assert mixed > 0  # embedding rows really shared forwards with decodes
    assert tokens == tokens_plain  # generation is unchanged by the interleaved embeddings
    for i, vec in enumerate(want):  # other chunk boundaries and row counts: float32 rounding at most
        assert torch.allclose(torch.tensor(got[i]), torch.tensor(vec), atol=1e-5, rtol=0), i
    assert engine.cache.used_cells() == 0  # every cell went back (no prefix cache)


def test_same_chunks_give_the_same_bits(model):
    """An embedding planned in the same chunks (a budget it fills alone) gives the same vector bitwise, whichever
    other request's rows share its forwards."""
    ids = prompt(8, seed=5)
    alone = make_engine(model=model, max_num_batched_tokens=64, prefix_caching=False).embed([ids], "last")[0]
    engine = make_engine(model=model, max_num_batched_tokens=64, prefix_caching=False)
    got = Collector()
    engine.add_request("g", GEN[0], greedy(4), got)
    engine.step()
    outs = {}
    engine.add_embedding("e", ids, "last", lambda out: outs.__setitem__("e", out))
    engine.step()  # one forward: the decode row and the whole embedding prompt
    assert outs["e"].finished and vector_of(outs["e"]) == alone
    drain(engine)
    assert got.finish[0] == "length"


def test_prefix_cache_keeps_the_cells_and_last_pooling_reuses_them(model):
    engine = make_engine(model=model, max_num_batched_tokens=64, prefix_caching=True)
    ids = prompt(40, seed=7)
    first = engine.embed([ids], "last")[0]
    assert engine.cache.used_cells() == 40  # kept as a cached prefix
    again = engine.embed([ids], "last")[0]  # shares 32 cached cells (two blocks), prefills the rest
    assert engine.stats().prefix_hit_tokens >= 32
    assert torch.allclose(torch.tensor(again), torch.tensor(first), atol=1e-5)
    assert torch.allclose(torch.tensor(first), oracle(model, ids, "last"), atol=1e-5)


def test_preempted_mean_embedding_restarts_its_sum(model):
    """Cells run out: the embedding (newest) is preempted and re-prefills; its mean counts each token once."""
    engine = make_engine(model=model, n_cells=64, max_num_batched_tokens=8, prefix_caching=False)
    long = prompt(40, seed=8)
    got = Collector()
    engine.add_request("g", prompt(20, seed=9), greedy(40), got)
    while len(got.tokens.get(0, [])) < 10:  # the generation holds 30 cells: the embedding's 40 fit only for a while
        engine.step()
    outs = {}
    engine.add_embedding("e", long, "mean", lambda out: outs.__setitem__("e", out))
    drain(engine)
    assert engine.stats().preemptions > 0
    assert torch.allclose(torch.tensor(vector_of(outs["e"])), oracle(model, long, "mean"), atol=1e-5)


def test_refusals_change_nothing(model):
    engine = make_engine(model=model, n_cells=32)
    for args, exc in ((([[1, 2]], "max"), InvalidRequest), (([[]], "last"), InvalidRequest),
                      (([list(range(3, 40))], "last"), PromptTooLong)):
        with pytest.raises(exc):
            engine.embed(*args)
    assert not engine.requests and not engine.has_unfinished()

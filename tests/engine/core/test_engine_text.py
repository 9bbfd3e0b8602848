"""Text through the engine: stop strings spanning tokens, stop token ids, EOS and ignore_eos,
max_tokens, and multibyte characters streamed in deltas that reassemble exactly.

Most tests use a *scripted* model: a real Llama whose weights make greedy decoding follow a chosen
token chain (tests/engine_support.scripted_model), so the expected text is known exactly.
"""

import itertools

import pytest
from engine_support import Collector, drain, make_engine, scripted_model, shared_tokenizer, text_model

from engine.api.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    return shared_tokenizer()


def _chain(tok, *texts, then=None) -> tuple[list[int], dict[int, int]]:
    """Token ids of the texts in order, and the successor map that makes a model walk them."""
    ids = [i for t in texts for i in tok.encode(t)]
    assert len(set(ids)) == len(ids), f"a scripted chain needs distinct tokens: {ids}"
    succ = dict(itertools.pairwise(ids))
    if then is not None:
        succ[ids[-1]] = then
    return ids, succ


def _run(tok, succ, prompt_ids, params, extra_succ=None) -> Collector:
    model = scripted_model(tok, {**succ, **(extra_succ or {})})
    engine = make_engine(model=model, tokenizer=tok, n_cells=128)
    got = Collector()
    engine.add_request("r", prompt_ids, params, got)
    drain(engine)
    assert got.finished and engine.free_cells() == 128
    return got


def test_scripted_model_walks_its_chain(tok):
    ids, succ = _chain(tok, "ROMEO: But soft, what light")
    got = _run(tok, succ, ids[:1], SamplingParams(max_tokens=len(ids) - 1, temperature=0))
    assert got.tokens[0] == ids[1:]
    assert got.text() == ": But soft, what light" and got.finish[0] == "length"


def test_stop_string_spanning_tokens(tok):
    ids, succ = _chain(tok, "ROMEO: But soft, what light")
    assert not any("t so" in tok.decode([i]) for i in ids), "the stop string must span tokens"
    got = _run(tok, succ, ids[:1], SamplingParams(max_tokens=20, temperature=0, stop=["light", "t so"]))
    assert got.finish[0] == "stop" and got.stop_reason[0] == "t so"
    assert got.text() == ": Bu"  # the stop string and everything after it is never sent
    assert got.tokens[0] == ids[1:4]  # generation ends at the token that completes the stop string


def test_stop_string_in_the_prompt_does_not_stop(tok):
    ids, succ = _chain(tok, "ROMEO: But")
    succ[ids[-1]] = ids[0]  # loop: ROMEO: But ROMEO: But ...
    got = _run(tok, succ, ids[:1], SamplingParams(max_tokens=20, temperature=0, stop=["ROMEO"]))
    assert got.text() == ": But" and got.stop_reason[0] == "ROMEO"


def test_stop_token_ids_keep_the_token_but_not_its_text(tok):
    ids, succ = _chain(tok, "ROMEO: But soft, what light")
    comma = tok.encode(",")[0]
    got = _run(tok, succ, ids[:1], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[comma]))
    assert got.finish[0] == "stop" and got.stop_reason[0] == comma
    assert got.tokens[0][-1] == comma and got.text() == ": But soft"


def test_eos_stops_unless_ignored(tok):
    eos = tok.eos_token_id
    ids, succ = _chain(tok, "ROMEO: But", then=eos)
    got = _run(tok, succ, ids[:1], SamplingParams(max_tokens=20, temperature=0), {eos: ids[0]})
    assert got.finish[0] == "stop" and got.stop_reason[0] is None
    assert got.tokens[0] == ids[1:] + [eos] and got.text() == ": But"
    n = 2 * len(ids) + 1
    got = _run(tok, succ, ids[:1], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), {eos: ids[0]})
    assert got.finish[0] == "length" and len(got.tokens[0]) == n
    assert got.tokens[0] == (ids[1:] + [eos] + ids)[: n] + [eos] * (n - 2 * len(ids))
    assert got.text() == ": ButROMEO: But"  # EOS is a special token: no text


def test_max_tokens_bounds_the_output(tok):
    ids, succ = _chain(tok, "ROMEO: But soft, what light")
    got = _run(tok, succ, ids[:1], SamplingParams(max_tokens=3, temperature=0))
    assert got.tokens[0] == ids[1:4] and got.finish[0] == "length" and got.text() == ": But soft"


def test_multibyte_characters_split_across_tokens_stream_whole(tok):
    ids, succ = _chain(tok, "Naïve café déjà vu", "日本語のテキスト🎉", then=tok.eos_token_id)
    assert any(REPLACEMENT in tok.decode([i]) for i in ids), "the chain must split characters across tokens"
    got = _run(tok, succ, ids[:1], SamplingParams(max_tokens=40, temperature=0))
    deltas = got.texts[0]
    assert "".join(deltas) == " café déjà vu日本語のテキスト🎉"
    assert not any(REPLACEMENT in d for d in deltas), "no delta carries half a character"
    assert "" in deltas[:-1], "some token's text was held back until its character completed"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_multibyte_text_reassembles_to_decode(tok, seed):
    """A random model pushed towards non-ASCII tokens: concatenated deltas == decode(generated ids)."""
    vocab = len(tok)
    non_ascii = [i for i in range(3, vocab) if not tok.decode([i]).isascii()]
    bias = {i: 4.0 for i in non_ascii}
    engine = make_engine(model=text_model(tok, seed=seed), tokenizer=tok, n_cells=256)
    got = [Collector() for _ in range(3)]
    for k, g in enumerate(got):  # batched, one greedy and two seeded samplers
        params = SamplingParams(max_tokens=30, temperature=0 if k == 0 else 1.0, seed=seed * 10 + k,
                                logit_bias=bias, ignore_eos=True)
        engine.add_request(str(k), tok.encode("Naïve café"), params, g)
    drain(engine)
    for g in got:
        text = tok.decode(g.tokens[0], skip_special_tokens=True)
        assert g.text() == text
        assert any(ord(ch) > 127 and ch != REPLACEMENT for ch in text)

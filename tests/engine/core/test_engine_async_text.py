"""Text made off the engine thread: for requests without stop strings the AsyncEngine's streams decode
the tokens on the event loop (`OutputDetokenizer`), and the deltas are exactly those the engine's own
detokenizer makes (same segmentation, multibyte characters whole, EOS / stop ids without text, n > 1,
persistent sequences). Requests with stop strings are still decoded, and cut, on the engine thread."""

import asyncio
import itertools
import threading

import pytest
from engine_support import Collector, drain, make_engine, scripted_model, shared_tokenizer, text_model

from engine.api.sampling_params import SamplingParams
from engine.core.async_engine import AsyncEngine


class RecordingTokenizer:
    """The tiny tokenizer, noting which threads call `decode`."""

    def __init__(self, tok):
        self._tok = tok
        self.decode_threads: set[str] = set()

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def decode(self, *args, **kwargs):
        self.decode_threads.add(threading.current_thread().name)
        return self._tok.decode(*args, **kwargs)


@pytest.fixture(scope="module")
def tok():
    return shared_tokenizer()


def _chain_model(tok):
    """A model that walks a multibyte text, then EOS, then starts over (so ignore_eos runs past it)."""
    ids = [i for t in ("Naïve café déjà vu", "日本語のテキスト🎉") for i in tok.encode(t)]
    assert len(set(ids)) == len(ids)
    succ = dict(itertools.pairwise(ids)) | {ids[-1]: tok.eos_token_id, tok.eos_token_id: ids[0]}
    return scripted_model(tok, succ), ids


# Both sides draft the same way: "auto" decides from measured step times, so two runs could group tokens into
# deltas differently; "ngram" drafts the same tokens in every run (and still merges several into one delta).
SAME_DRAFTS = "ngram"


def _engine_side(model, tok, prompt_ids, params) -> list[list[str]]:
    engine = make_engine(model=model, tokenizer=tok, n_cells=256, speculative=SAME_DRAFTS)
    got = Collector()
    engine.add_request("r", prompt_ids, params, got)
    drain(engine)
    return [got.texts[i] for i in sorted(got.texts)]


def _async_side(model, tok, prompt_ids, params) -> tuple[list[list[str]], RecordingTokenizer]:
    recording = RecordingTokenizer(tok)
    aeng = AsyncEngine.launch(lambda: make_engine(model=model, tokenizer=recording, n_cells=256, speculative=SAME_DRAFTS))
    texts: dict[int, list[str]] = {}

    async def main():
        async for out in await aeng.submit("r", prompt_ids, params):
            for c in out.outputs:
                texts.setdefault(c.index, []).append(c.text)
        await aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))
    return [texts[i] for i in sorted(texts)], recording


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=0),  # ends on EOS: its token carries no text
    SamplingParams(max_tokens=7, temperature=0),  # ends by length mid-character: the flush gives it up
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),  # runs past EOS
    SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[5]),
], ids=["eos", "length", "ignore_eos", "stop_token_ids"])
def test_event_loop_text_equals_engine_text(tok, params):
    model, ids = _chain_model(tok)
    if params.stop_token_ids:
        params = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ids[9]])
    expected = _engine_side(model, tok, ids[:1], params)
    got, recording = _async_side(model, tok, ids[:1], params)
    assert got == expected
    assert "".join(expected[0])
    assert "cellserve-engine" not in recording.decode_threads
    assert recording.decode_threads == {threading.current_thread().name}


def test_n_choices_sampled_text_equals_engine_text(tok):
    non_ascii = {i: 4.0 for i in range(3, len(tok)) if not tok.decode([i]).isascii()}
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, n=3, logit_bias=non_ascii, ignore_eos=True)
    model = text_model(tok, seed=3)
    expected = _engine_side(model, tok, tok.encode("Naïve café"), params)
    got, recording = _async_side(model, tok, tok.encode("Naïve café"), params)
    assert len(got) == 3 and got == expected
    assert "cellserve-engine" not in recording.decode_threads


def test_stop_strings_are_still_cut_on_the_engine_thread(tok):
    model, ids = _chain_model(tok)
    params = SamplingParams(max_tokens=40, temperature=0, stop=["déjà"])
    expected = _engine_side(model, tok, ids[:1], params)
    got, recording = _async_side(model, tok, ids[:1], params)
    assert got == expected and "".join(got[0]) == " café "
    assert "cellserve-engine" in recording.decode_threads


def test_continuing_a_sequence_decodes_with_its_history_as_context(tok):
    """Each continuation's first token reads the sequence's last tokens as context, as on the engine."""
    model, ids = _chain_model(tok)
    params = SamplingParams(max_tokens=5, temperature=0)
    engine = make_engine(model=model, tokenizer=tok, n_cells=256)
    seq, _ = engine.create_sequence(ids[:3])
    drain(engine)
    expected = []
    for k in range(3):
        got = Collector()
        engine.add_request(f"r{k}", [], params, got, seq.seq_id)
        drain(engine)
        expected.append(got.texts[0])

    recording = RecordingTokenizer(tok)
    aeng = AsyncEngine.launch(lambda: make_engine(model=model, tokenizer=recording, n_cells=256, speculative=SAME_DRAFTS))

    async def main():
        info = await aeng.create_sequence(ids[:3])
        texts = []
        for k in range(3):
            texts.append([out.outputs[0].text async for out in await aeng.submit(f"r{k}", [], params,
                                                                                    seq_id=info.seq_id)])
        await aeng.shutdown()
        return texts

    got = asyncio.run(asyncio.wait_for(main(), 60))
    assert got == expected and "".join(itertools.chain(*got))
    assert "cellserve-engine" not in recording.decode_threads

"""IncrementalDetokenizer against `tokenizer.decode` on real tokenizers trained offline (no downloads).

Two tokenizer families: GPT-2 style byte-level BPE, and Llama/SentencePiece style (metaspace "▁" with a
prefix space, byte-fallback tokens <0xNN>, leading space stripped on decode).
"""

import functools
import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.core.detokenizer import IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! Stop here and go.",
    "Café crème brûlée à la carte, naïve façade, Ærøskøbing.",
    "日本語のテキストです。東京都。中文字符测试。",
    "Emoji time: 🙂🚀🎉👍🏽 and 🇫🇷 flags.",
    "Ελληνικά κείμενα και русский текст тоже.",
] * 3
FFFD = "\ufffd"


@functools.cache
def byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@functools.cache
def sentencepiece_style() -> PreTrainedTokenizerFast:
    """Llama layout: spaces -> "▁" with one prepended, BPE with byte fallback, decode strips one leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte-fallback pieces are ordinary (non-special) vocabulary entries
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"byte_level": byte_level_bpe, "sentencepiece": sentencepiece_style}


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream(det: IncrementalDetokenizer, ids) -> list[str]:
    return [det.push(t) for t in ids] + [det.flush()]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_tokenizers_really_split_characters(name):
    """Guard for the tests below: some tokens hold only part of a character, so the hold-back is exercised."""
    tok = TOKENIZERS[name]()
    ids = encode(tok, "東京 🙂 brûlée 🚀 русский")
    assert decode(tok, ids) == "東京 🙂 brûlée 🚀 русский"
    assert any(FFFD in decode(tok, [t]) for t in ids)


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40), cut=st.integers(min_value=0, max_value=1000))
def test_streamed_deltas_equal_decode(name, text, cut):
    """Any text, split anywhere into prompt + output, streamed one token at a time."""
    tok = TOKENIZERS[name]()
    ids = encode(tok, text)
    k = cut % (len(ids) + 1)
    prompt_text, full_text = decode(tok, ids[:k]), decode(tok, ids)
    assume(full_text.startswith(prompt_text))  # a prompt ending mid-character has no defined continuation
    expected = full_text[len(prompt_text):]
    det = IncrementalDetokenizer(tok, prompt_ids=ids[:k])
    deltas = stream(det, ids[k:])
    assert "".join(deltas) == expected
    assert det.text == expected and det.output_ids == ids[k:]
    assert not det.stopped and det.stop_reason is None
    if FFFD not in expected:
        assert all(FFFD not in d for d in deltas)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_multibyte_characters_are_never_split(name):
    tok = TOKENIZERS[name]()
    text = "日本語 🙂🚀🎉 Ærø 中文 👍🏽"
    ids = encode(tok, text)
    det = IncrementalDetokenizer(tok)
    deltas = stream(det, ids)
    assert "".join(deltas) == text
    assert all(FFFD not in d for d in deltas)
    assert sum(d == "" for d in deltas[:-1]) > 0  # some tokens were held back


def test_prefix_space_comes_from_prompt_context():
    """SentencePiece decode drops a leading space; with the prompt as context the space is kept."""
    tok = sentencepiece_style()
    ids = encode(tok, "Hello world")
    k = next(i for i in range(1, len(ids)) if decode(tok, ids[:i]) == "Hello")
    assert decode(tok, ids[k:]) == "world"  # decoding the output alone loses the space
    det = IncrementalDetokenizer(tok, prompt_ids=ids[:k])
    assert "".join(stream(det, ids[k:])) == " world"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_prompt_context_window_never_starts_inside_a_character(name):
    """Five prompt tokens back lands inside "ǅ"; a byte-fallback decoder would then turn the whole byte run
    (prompt tail + output) into U+FFFD unless the window is moved back to a character boundary."""
    tok = TOKENIZERS[name]()
    ids = encode(tok, "ǅ𐀀ǅ")
    k = next(k for k in range(len(ids)) if decode(tok, ids[:k]) == "ǅ𐀀")
    if name == "sentencepiece":
        assert tok.convert_ids_to_tokens(ids[k - 6:]) == ["<0xC7>", "<0x85>", "<0xF0>", "<0x90>", "<0x80>",
                                                          "<0x80>", "<0xC7>", "<0x85>"]
    det = IncrementalDetokenizer(tok, prompt_ids=ids[:k])
    assert "".join(stream(det, ids[k:])) == "ǅ"


def test_push_accepts_several_tokens_and_skips_special_tokens():
    tok = byte_level_bpe()
    eos = tok.eos_token_id
    ids = encode(tok, "Café 🙂 ok")
    det = IncrementalDetokenizer(tok)
    out = det.push(ids[:3]) + det.push([eos]) + det.push(ids[3:]) + det.flush()
    assert out == "Café 🙂 ok"
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert keep.push(ids + [eos]) + keep.flush() == "Café 🙂 ok<|endoftext|>"


# ---------------------------------------------------------------- stop strings

def test_stop_string_spanning_tokens_is_cut():
    tok = byte_level_bpe()
    text = "Hello world. Xylophone! and more text after"
    ids = encode(tok, text)
    assert not any("Xylophone" in decode(tok, [t]) for t in ids)  # the stop string spans several tokens
    det = IncrementalDetokenizer(tok, stop=["Xylophone", "never"])
    deltas = [det.push(t) for t in ids]
    assert "".join(deltas) == "Hello world. "
    assert det.stopped and det.stop_reason == "Xylophone"
    assert det.text == "Hello world. "
    assert det.flush() == ""


def test_earliest_stop_string_wins():
    tok = byte_level_bpe()
    det = IncrementalDetokenizer(tok, stop=["fox", "quick"])
    out = det.push(encode(tok, "The quick brown fox")) + det.flush()
    assert out == "The " and det.stop_reason == "quick"


def test_partial_stop_prefix_is_held_then_released():
    tok = byte_level_bpe()
    det = IncrementalDetokenizer(tok, stop=["STOP!"])
    assert det.push(encode(tok, "go ST")) == "go "  # "ST" may start "STOP!": held back
    assert det.text == "go "
    assert det.push(encode(tok, "OP")) == ""  # "STOP" still may
    assert det.push(encode(tok, " now")) == "STOP now"  # "STOP " cannot: released
    assert not det.stopped
    assert det.push(encode(tok, " STO")) == " "
    assert det.flush() == "STO"  # flush gives up the held-back remainder
    assert det.text == "go STOP now STO"
    with pytest.raises(RuntimeError):
        det.push(1)


def test_pushes_after_a_stop_return_nothing():
    tok = byte_level_bpe()
    det = IncrementalDetokenizer(tok, stop="end")
    assert det.push(encode(tok, "the end")) == "the "
    assert det.push(encode(tok, " and more")) == ""
    assert det.flush() == "" and det.text == "the "


def test_stop_strings_are_not_searched_in_the_first_min_tokens():
    tok = byte_level_bpe()
    ids = encode(tok, "the end and the end")
    n = len(encode(tok, "the end"))
    held = IncrementalDetokenizer(tok, stop=["end"], min_tokens=n)
    assert "".join(held.push(t) for t in ids) == "the end and the " and held.stop_reason == "end"
    eager = IncrementalDetokenizer(tok, stop=["end"])
    assert eager.push(ids) == "the " and eager.stopped


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(byte_level_bpe(), stop=["ok", ""])


def emitted_oracle(decoded: str, stops: list[str], final: bool) -> str:
    """What may have been sent once `decoded` is known, if no stop string appeared earlier: cut at the
    earliest stop string; unless final, minus the longest suffix that is a proper prefix of a stop string."""
    hits = [decoded.find(s) for s in stops if s in decoded]
    if hits:
        return decoded[:min(hits)]
    if final:
        return decoded
    hold = max((k for k in range(1, len(decoded) + 1) for s in stops
                if k < len(s) and s.startswith(decoded[-k:])), default=0)
    return decoded[:len(decoded) - hold]


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(data=st.data(), text=st.text(alphabet=st.sampled_from("ab é日🙂."), max_size=30))
def test_stop_strings_match_oracle_after_every_token(name, data, text):
    tok = TOKENIZERS[name]()
    stops = data.draw(st.lists(st.text(alphabet=st.sampled_from("ab é日🙂."), min_size=1, max_size=4),
                               min_size=1, max_size=3))
    ids = encode(tok, text)
    det = IncrementalDetokenizer(tok, stop=stops)
    frozen = None  # the oracle's text once a stop string has appeared in a complete decode
    for i, t in enumerate(ids):
        det.push(t)
        decoded = decode(tok, ids[:i + 1])
        if decoded.endswith(FFFD):
            continue  # mid-character: nothing is visible yet (covered by the next complete state)
        if frozen is None:
            expected = emitted_oracle(decoded, stops, final=False)
            if any(s in decoded for s in stops):
                frozen = expected
        assert det.text == (frozen if frozen is not None else expected)
        assert det.stopped == (frozen is not None)
    det.flush()
    full = decode(tok, ids)
    assert det.text == (frozen if frozen is not None else emitted_oracle(full, stops, final=True))
    assert det.stopped == any(s in full for s in stops)
    if det.stopped:
        assert det.stop_reason in stops and full[len(det.text):].startswith(det.stop_reason)

"""The tokenizer a GGUF file carries (engine/loader/gguf_tokenizer.py) against the Hugging Face tokenizer it was
written from: the same ids for sample strings, text back as text (no byte-level `Ġ`), the file's special tokens
and chat template, whatever the architecture the file names; an unknown tokenizer model or pre-tokenizer is an
error naming it."""

import gguf
import pytest
from tiny_models import CHAT_TEMPLATE, CORPUS, tiny_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.api.errors import ModelSourceError
from engine.loader.default import DEFAULT_MODEL_DIR
from engine.loader.gguf import read_gguf_metadata
from engine.loader.gguf_tokenizer import tokenizer_from_gguf

SAMPLES = [*CORPUS, "Nutritional facts: 12345 grams, 3.14159!", "  leading and  double  spaces\n\ttabs\n",
           "<|bos|>a special token inside<|eos|>", "don't won't we'll I'm", ""]


def write_tokenizer_gguf(path, arch: str, hf, model: str, pre: str | None = None, scores=None, add_bos=None):
    """A GGUF file holding only `hf`'s tokenizer, as llama.cpp's converter writes one (no tensors)."""
    w = gguf.GGUFWriter(str(path), arch)
    data = hf.backend_tokenizer if hasattr(hf, "backend_tokenizer") else hf
    vocab = sorted(data.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    special = {t.content for t in data.get_added_tokens_decoder().values() if t.special}
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 6 if t.startswith("<0x") else 1 for t, _ in vocab])
    if scores is not None:
        w.add_token_scores(scores)
    if model == "gpt2":
        import json

        w.add_token_merges([" ".join(m) if isinstance(m, list) else m
                            for m in json.loads(data.to_str())["model"]["merges"]])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    ids = {t: i for t, i in vocab}
    for key, tok in (("bos", "<|bos|>"), ("eos", "<|eos|>"), ("pad", "<|pad|>")):
        if tok in ids:
            getattr(w, f"add_{key}_token_id")(ids[tok])
    w.add_chat_template(CHAT_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _read(path):
    return tokenizer_from_gguf(path, read_gguf_metadata(path, arrays=True))


def _smollm_like():
    """SmolLM2's layout (digits one at a time, then GPT-2's byte-level split), trained on the corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"])
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")


def _assert_same(ours, theirs, add_special_tokens=False):
    for text in SAMPLES:
        ids = theirs.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == ids, text
        back = ours.decode(ids, skip_special_tokens=False)
        assert back == theirs.decode(ids, skip_special_tokens=False)
        assert "Ġ" not in back and "▁" not in back


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
@pytest.mark.parametrize("which", ["bundled", "smollm"])
def test_a_gpt2_bpe_in_any_architecture_reads_as_text(arch, which, tmp_path):
    theirs = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR) if which == "bundled" else _smollm_like()
    pre = "gpt-2" if which == "bundled" else "smollm"
    path = write_tokenizer_gguf(tmp_path / "t.gguf", arch, theirs, "gpt2", pre)
    ours = _read(path)
    _assert_same(ours, theirs)
    assert ours.decode(ours.encode("Nutritional facts")) == "Nutritional facts"
    assert ours.bos_token == "<|bos|>" and ours.eos_token == "<|eos|>"
    assert ours.encode("<|eos|>", add_special_tokens=False) == [theirs.eos_token_id]
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "<|user|>hi\n<|assistant|>"


def test_add_bos_follows_the_file(tmp_path):
    theirs = tiny_tokenizer()
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "qwen3", theirs, "gpt2", "gpt-2", add_bos=True)
    ids = _read(path).encode("hello")
    assert ids[0] == theirs.bos_token_id and ids[1:] == theirs.encode("hello", add_special_tokens=False)


def test_a_sentencepiece_file_reads_as_text(tmp_path):
    """A `llama` (SentencePiece BPE) tokenizer: pieces with `▁` for spaces, byte fallback, merges ranked by score
    (a piece's score: minus the rank of the merge that made it, as SentencePiece BPE models score them)."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  special_tokens=["<unk>", "<|bos|>", "<|eos|>", *bytes_])
    tok.train_from_iterator([t.replace(" ", "▁") for t in CORPUS * 4], trainer)
    import json

    spec = json.loads(tok.to_str())
    rank = {("".join(m) if isinstance(m, list) else m.replace(" ", "")): i for i, m in enumerate(spec["model"]["merges"])}
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    scores = [-float(rank[t]) - 1 if t in rank else 0.0 for t, _ in vocab]
    theirs = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|bos|>")
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "gemma3", theirs, "llama", scores=scores, add_bos=False)
    ours = _read(path)
    for text in SAMPLES[:4] + ["hello world", "Romeo, Romeo"]:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids) == text


@pytest.mark.parametrize("model,pre,match", [("bert", None, "tokenizer model 'bert'"),
                                             ("gpt2", "made-up-pre", "pre-tokenizer 'made-up-pre'")])
def test_an_unknown_tokenizer_is_an_error_naming_it(model, pre, match, tmp_path):
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "qwen3", tiny_tokenizer(), model, pre)
    with pytest.raises(ModelSourceError, match=match):
        _read(path)

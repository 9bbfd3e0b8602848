"""The tokenizer and chat template a GGUF file carries, built with `tokenizers` from its `tokenizer.ggml.*` keys.

Whatever the architecture, the file names its tokenizer: `tokenizer.ggml.model` (`gpt2`: byte-level BPE with
`merges`; `llama`: SentencePiece with `scores`), the pre-tokenizer (`tokenizer.ggml.pre`, llama.cpp's name for a
split pattern), the tokens and their types (control tokens are special, user-defined ones are matched whole),
the special ids, whether BOS is added, and `tokenizer.chat_template`. transformers' GGUF converter instead picks a
tokenizer class by architecture (a Gemma 3 file with a GPT-2 BPE came out as `ĠNutritionalĠ...`), so it is not
used here. The pieces are built by hand from `tokenizers`' own components because no library maps llama.cpp's
metadata to them without that per-architecture guess; the tables below are llama.cpp's (src/llama-vocab.cpp).

- `gpt2`: `models.BPE` over the file's byte-level tokens and merges, the pre-tokenizer `PRE_TOKENIZERS[pre]`
  (a split regex, optionally digits one at a time, then the byte-level mapping), the byte-level decoder.
- `llama`: SentencePiece BPE: merges rebuilt from the scores (a pair of pieces whose concatenation is a piece
  merges at that piece's score, higher first, as transformers' SpmConverter does), spaces as `▁`, a `▁` prefix
  where `tokenizer.ggml.add_space_prefix` (default true) says, byte fallback to the `<0xNN>` tokens.
An unknown tokenizer model or pre-tokenizer is an error that names it (`ModelSourceError`), never a guess.
"""

from pathlib import Path

from engine.api.errors import ModelSourceError

# llama.cpp's split patterns (llama-vocab.cpp), by the pre-tokenizer names its converter writes
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# name -> (split regex, digits one at a time first)
PRE_TOKENIZERS = {
    "gpt-2": (_GPT2, False), "default": (_GPT2, False),  # llama.cpp's default's main expression is GPT-2's
    "smollm": (_GPT2, True), "starcoder": (_GPT2, True), "refact": (_GPT2, True), "codeshell": (_GPT2, True),
    "llama3": (_LLAMA3, False), "llama-bpe": (_LLAMA3, False), "falcon3": (_LLAMA3, False),
    "qwen2": (_QWEN2, False), "deepseek-r1-qwen": (_QWEN2, False), "qwen35": (_QWEN2, False),
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (1 normal, 2 unknown, 5 unused, 6 byte)


def tokenizer_from_gguf(path: str | Path, meta: dict):
    """A `PreTrainedTokenizerFast` of the file's own tokenizer, special tokens and chat template. `meta`: the
    file's metadata with arrays (engine/loader/gguf.py's `read_gguf_metadata(path, arrays=True)`)."""
    from transformers import PreTrainedTokenizerFast

    name = Path(path).name
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelSourceError(f"{name} carries no tokenizer (no tokenizer.ggml.tokens); it cannot be served alone")
    if model == "gpt2":
        tok = _byte_level_bpe(meta, name)
    elif model == "llama":
        tok = _sentencepiece_bpe(meta)
    else:
        raise ModelSourceError(f"{name}: tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE and "
                               f"'llama' SentencePiece); serve a Hugging Face folder of this model instead")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    _add_special_tokens(tok, tokens, types)
    specials = _special_tokens(meta, tokens)
    _add_bos(tok, meta, specials.get("bos_token"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=meta.get("tokenizer.chat_template"),
                                   clean_up_tokenization_spaces=False, **specials)


def _byte_level_bpe(meta: dict, name: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelSourceError(f"{name}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not known here (known: "
                               f"{', '.join(sorted(PRE_TOKENIZERS))}); serve a Hugging Face folder of this model")
    pattern, digits = PRE_TOKENIZERS[pre]
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: dict):
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for t, score in zip(tokens, scores):
        for i in range(1, len(t)):
            left, right = t[:i], t[i:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=None if unk is None else tokens[unk], byte_fallback=True,
                               fuse_unk=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tail = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *tail])
    return tok


def _add_special_tokens(tok, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special added tokens (matched whole, skipped when decoding with skip_special_tokens),
    user-defined ones as plain added tokens (matched whole, kept: Qwen3's `<think>`)."""
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])


def _special_tokens(meta: dict, tokens: list[str]) -> dict:
    out = {}
    for key, field in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                       ("pad_token", "padding_token_id")):
        i = meta.get(f"tokenizer.ggml.{field}")
        if i is not None and 0 <= int(i) < len(tokens):
            out[key] = tokens[int(i)]
    return out


def _add_bos(tok, meta: dict, bos: str | None) -> None:
    """BOS before every encoded text where the file asks (`tokenizer.ggml.add_bos_token`; llama.cpp's default
    for SentencePiece files is yes, for byte-level BPE no)."""
    from tokenizers import processors

    default = meta.get("tokenizer.ggml.model") == "llama"
    if bos is None or not meta.get("tokenizer.ggml.add_bos_token", default):
        return
    bos_id = meta["tokenizer.ggml.bos_token_id"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, bos_id)])

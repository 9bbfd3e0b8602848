"""The engine's side of the memory account: weights, the cell pool, the step buffers' bound and the caches of
the runners an engine holds (engine/api/memory.py says what each owner is; the server exports them).

The step buffers' bound, for a step of B = `max_num_batched_tokens` rows of a model of hidden size H, MLP
width I, nq query and nkv KV heads of width D, vocabulary V, context C, activations of `a` bytes (4 for
float32 and quantized weights, 2 for bf16/fp16):

    activations  B x (4 H + (nq + 2 nkv) D + 3 I) x a      residual, norm, QKV, attention out, gate|up, SiLU
    attention    B x C x nq x 4                            a prefill chunk's scores against its context
    logits       B x V x (a + 36)                          every row's logits (sampled rows, drafts, prompt
                                                           logprobs): the head's output, fp32 logits, and the
                                                           sampler's copies (scaled, sorted values and int64
                                                           indices, probabilities, log-probabilities)
    dequantized  N x K x 2 of the largest quantized linear a prefill of 72+ rows reads in bf16 (0 for float)

Every row of a step is bounded by B (the scheduler never plans more: prompts are chunked, `n` choices and
drafts are rows of the same budget, prompt logprobs come from the rows the prefill computes), so no request
can make a step allocate beyond this (prompt logprobs are scored in blocks of 64 rows,
engine/core/prompt_logprobs.py, so their log-softmax adds only 64 x V x 9); the burst test (tests/server/test_memory_burst.py) checks the
server's peak against it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.api.memory import MemoryReport, allocator_free, process_rss

LOGIT_ROW_BYTES = 36  # per logit beyond the head's own output: fp32 logits (4) + the sampler's copies (32)


def _shape(config) -> dict:
    cfg = config.get_text_config()
    heads = cfg.num_attention_heads
    return {"H": cfg.hidden_size, "I": getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size,
            "nq": heads, "nkv": getattr(cfg, "num_key_value_heads", None) or heads,
            "D": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, "V": cfg.vocab_size}


def step_buffer_bytes(runner, max_num_batched_tokens: int) -> int:
    """The most one step of `max_num_batched_tokens` rows allocates on `runner`'s model (the formula above)."""
    s, b = _shape(runner.config), max_num_batched_tokens
    quantized = _quantized(runner)
    a = 4 if quantized or runner.dtype == torch.float32 else 2
    context = min(runner.max_model_len, runner.n_cells)
    activations = b * (4 * s["H"] + (s["nq"] + 2 * s["nkv"]) * s["D"] + 3 * s["I"]) * a
    attention = b * context * s["nq"] * 4
    logits = b * s["V"] * (a + LOGIT_ROW_BYTES)
    dequantized = _largest_linear(runner) * 2 if quantized else 0
    return activations + attention + logits + dequantized


def _quantized(runner) -> bool:
    """Whether the forward runs quantized linears (a GGUF served from its blocks, `--quantize`)."""
    from engine.model.native.quant import QuantLinear

    native = runner.native
    if native is None:
        return False
    linears = [lin for lin in native.layers[0].linears() if lin is not None]
    linears += [part for lin in linears for part in getattr(lin, "parts", None) or ()]
    return any(isinstance(lin, QuantLinear) for lin in linears)


def _largest_linear(runner) -> int:
    """Weights (N x K) of the model's largest linear: the LM head's V x H, or the MLP's I x H."""
    s = _shape(runner.config)
    return max(s["V"], 2 * s["I"]) * s["H"]


def weight_bytes(runner) -> int:
    """Bytes the forward's weights hold (the native forward's tensors, else the transformers parameters)."""
    if runner.native is not None:
        from engine.model.native.quant import weight_bytes as native_bytes

        return native_bytes(runner.native)
    return sum(p.numel() * p.element_size() for p in runner.model.parameters()
               if p.untyped_storage().nbytes() > p.element_size())


def tokenizer_bytes(tokenizer) -> int:
    """The tokenizer's vocabulary and merges as serialized (its in-memory tables are of that order)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return len(backend.to_str()) if backend is not None else 0


class MemoryAccount:
    """Resident memory by owner for one engine's runners (the target and a draft model's). Static parts
    (weights, pools, the bound, the tokenizer) are computed once; caches and the process are read per call.
    Safe to call from any thread (it only reads)."""

    def __init__(self, runners: list, max_num_batched_tokens: int, *, grammar: Callable[[], int],
                 prefix: Callable[[], int], adapters: Callable[[], int] = lambda: 0):
        self.weights = sum(weight_bytes(r) for r in runners)
        self.cell_pool = sum(r.n_cells * r.cell_bytes for r in runners)
        self.step_buffers = max(step_buffer_bytes(r, max_num_batched_tokens) for r in runners)
        self.tokenizer = tokenizer_bytes(runners[0].tokenizer) if runners[0].tokenizer is not None else 0
        self._grammar, self._prefix, self._adapters = grammar, prefix, adapters

    def report(self) -> MemoryReport:
        rss, peak = process_rss()
        caches = {"grammar_cache": self._grammar(), "prefix_index": self._prefix(), "tokenizer": self.tokenizer,
                  "lora_adapters": self._adapters()}
        return MemoryReport(self.weights, self.cell_pool, self.step_buffers, caches, allocator_free() or 0, rss, peak)

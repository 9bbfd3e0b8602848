"""ModelRunner: an unmodified Hugging Face causal LM running flat multi-sequence steps over cells.

One forward takes the tokens of many sequences on one token axis (batch 1). The runner plans the
step on the `CellCache` (claims cells, builds the visibility mask), calls the model with explicit
`position_ids` and 4D mask, and returns logits only for the rows asked for. If the forward raises,
the cells the step claimed are released, so the cache is exactly as it was before the call.
A step arrives as a `FlatStep` (engine/model/flat_step.py).
"""

import inspect
import logging
import os
from pathlib import Path

import torch

from engine.api.args import KV_CACHE_DTYPES, kv_cache_dtype_for
from engine.api.errors import ModelSourceError
from engine.cells import int8_kv
from engine.cells.cache import DEFAULT_MAX_SEQS, CellCache
from engine.cells.plan import row_gather_for
from engine.loader.gguf_tensors import is_gguf_folder, load_gguf_model
from engine.loader.hf import load_hf_folder
from engine.loader.quantize import load_quantized_folder
from engine.model import heap, module_weights
from engine.model.flat_step import FlatStep, flatten_step
from engine.model.hf_attention import (
    ATTENTION_PATHS,
    GATHER,
    build_mask,
    mask_spec_for,
    register_cell_attention,
)
from engine.model.lora import Dims, LoraRegistry
from engine.model.native.linear import two_copies
from engine.model.native.model import NativeLlama, native_unsupported
from engine.model.native.rows import drafted_step

DEFAULT_N_CELLS = 8192
log = logging.getLogger("cellserve.runner")


def kv_bytes_per_cell(config, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one cell (one token's K and V over all layers) takes in the pools: `dtype`'s size per value, or
    for int8 cells one byte per value plus a float32 scale per (layer, kv head) row of K and of V."""
    cfg = config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if kv_cache_dtype == "int8":
        return 2 * cfg.num_hidden_layers * kv_heads * (head_dim + int8_kv.SCALE_BYTES)
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_dtype_of(kv_cache_dtype: str) -> torch.dtype | None:
    """The pools' storage dtype for a resolved `--kv-cache-dtype` (None: the model's own); a clear error
    otherwise."""
    if kv_cache_dtype not in KV_CACHE_DTYPES or kv_cache_dtype == "auto":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: use one of model, int8 (auto is resolved by "
                         f"engine.api.args.kv_cache_dtype_for first)")
    return torch.int8 if kv_cache_dtype == "int8" else None


def max_model_len(config) -> int:
    cfg = config.get_text_config()
    return int(getattr(cfg, "max_position_embeddings", 0) or getattr(cfg, "n_positions", 0) or 2048)


class ModelRunner:
    """Owns the model, its tokenizer and the cell pool; runs one flat step per `forward` call.

    `attention="fast"` reads only the cells visible to the step (compacted window);
    `attention="reference"` reads the whole window with a dense mask (the oracle in tests).
    With "fast", an sdpa model is switched to the `cell_gather` attention implementation; outside a
    cell step (no `cell_rows` given) it behaves exactly like sdpa, so the model stays usable as is.

    `native` (fast path only): run Llama-family models through `NativeLlama`, the same math in fused
    ops over the same pools. None (default) = whenever the model is supported (unless the environment
    sets CELLSERVE_NATIVE=0); False = always the transformers modules (which stay the oracle and the
    path for every other architecture).

    `tensors`: a GGUF file's weights, quantized linears kept quantized (engine/loader/gguf_tensors.py);
    `model` is then a placeholder skeleton and only the native forward can run it.

    `kv_cache_dtype`: "model" keeps the cells in the model's dtype; "auto" is int8 when the weights are
    quantized (`tensors` given) and "model" otherwise (`kv_cache_dtype_for`); "int8" stores them as int8 with a float32
    scale per (cell, kv head) (`engine/cells/int8_kv.py`), so a `kv_memory_bytes` budget holds ~2x the cells
    of bf16 (~4x of float32). The native forward writes and reads them in place (fused kernels, or eager
    ops dequantizing only the rows a step reads); the transformers path dequantizes the step's read window.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        n_cells: int | None = None,
        kv_memory_bytes: int | None = None,
        max_seqs: int = DEFAULT_MAX_SEQS,
        threads: int | None = None,
        attention: str = "fast",
        native: bool | None = None,
        tensors: dict | None = None,
        kv_cache_dtype: str = "auto",
    ):
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention={attention!r}: choose one of {ATTENTION_PATHS}")
        kv_cache_dtype = kv_cache_dtype_for(kv_cache_dtype, quantized_weights=tensors is not None)
        kv_dtype = kv_dtype_of(kv_cache_dtype)
        if threads:
            torch.set_num_threads(threads)
        self.model = model.eval()
        self.gather = attention == "fast" and model.config._attn_implementation == "sdpa"
        if self.gather:  # sdpa models get the per-row gather kernel; it falls back to sdpa by itself
            register_cell_attention()
            model.set_attn_implementation(GATHER)
        self.tokenizer = tokenizer
        self.config = model.config
        self.device = model.device
        self.dtype = model.dtype
        self.spec = mask_spec_for(model)
        self.kv_cache_dtype = kv_cache_dtype
        self.cell_bytes = kv_bytes_per_cell(self.config, self.dtype, kv_cache_dtype)
        self.max_model_len = max_model_len(self.config)
        if n_cells is None:
            n_cells = kv_memory_bytes // self.cell_bytes if kv_memory_bytes else DEFAULT_N_CELLS
        n_layers = self.config.get_text_config().num_hidden_layers
        self.cache = CellCache(n_cells, n_layers, max_seqs, compact=attention == "fast", device=self.device,
                               kv_dtype=kv_dtype)
        self.attention = attention
        if native is None and os.environ.get("CELLSERVE_NATIVE") == "0":  # escape hatch, and A/B benchmarks
            native = False
        reason = native_unsupported(model) if attention == "fast" else "the reference path is the oracle"
        if tensors is not None and (native is False or reason):
            raise ValueError(f"quantized GGUF weights run only on the native forward ({reason or 'native=False'})")
        if native and reason:
            raise ValueError(f"native=True but {reason}")
        self.native = NativeLlama(model, self.spec, tensors) if native is not False and reason is None else None
        if self.native is None and native is None and attention == "fast":
            log.warning("%s runs on the transformers fallback (the unmodified modules, slower), not the native "
                        "forward: %s", type(model).__name__, reason)
        self.loras = self._lora_registry()  # LoRA adapters (engine/model/lora.py): the native forward only
        self._samples = None  # the modules' weight samples, kept once their weights are released
        # transformers 5.24 renamed `past_key_values` to `cache`; accept both so 5.23 keeps working.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype | str = "auto",
        attn_implementation: str = "sdpa",
        device: str = "cpu",
        quantize: str | None = "none",
        **kwargs,
    ) -> "ModelRunner":
        """Load a local Hugging Face causal-LM folder (config, safetensors, tokenizer); never downloads.

        `dtype="auto"`: bfloat16 on CPUs with AVX512-BF16/AMX (about twice float32's speed there), float32
        elsewhere, whatever the checkpoint holds (engine/api/cpu.py); a name like "bfloat16" or a torch
        dtype forces one. A GGUF file served from its own blocks ignores `dtype`.
        `quantize="int8"|"int4"`: the linears quantized at load into 32-weight blocks and run on the
        native forward's quantized kernels (engine/loader/quantize.py); `dtype` then holds the matrices
        left float (the embedding, when not tied to the head).
        The heap the load freed on the way goes back to the OS at the end (engine/model/heap.py).
        """
        heap.cap()  # big transient tensors mapped and unmapped, not kept in malloc's arenas (engine/model/heap.py)
        runner = cls._load(path, dtype, attn_implementation, device, quantize, **kwargs)
        heap.trim()
        return runner

    @classmethod
    def _load(cls, path, dtype, attn_implementation, device, quantize, **kwargs) -> "ModelRunner":
        if quantize not in (None, "none"):
            return cls._quantized(path, quantize, dtype, **kwargs)
        if is_gguf_folder(path):  # weights served from the GGUF file as they are (dtype "quantized")
            model, tokenizer, tensors = load_gguf_model(path)
            return cls(model, tokenizer, tensors=tensors, **kwargs)
        if dtype == "quantized":
            raise ValueError(f"dtype 'quantized' serves a .gguf file's own blocks; {path} is a float folder "
                             f"(to quantize it, use --quantize int8 or int4)")
        model, tokenizer = load_hf_folder(path, dtype=dtype, attn_implementation=attn_implementation, device=device)
        runner = cls(model, tokenizer, **kwargs)
        runner.release_module_weights()  # the model is this runner's own: one copy of the weights
        return runner

    @classmethod
    def _quantized(cls, path, quantize: str, dtype, **kwargs) -> "ModelRunner":
        if is_gguf_folder(path):
            raise ModelSourceError(
                f"--quantize {quantize} quantizes float weights, but {path} is served from a GGUF file's own "
                f"quantized blocks: drop --quantize to run the file's blocks as they are, or add --dtype float32 "
                f"to dequantize the file once (cached) and quantize that")
        if str(dtype) == "quantized":
            raise ModelSourceError(f"dtype 'quantized' serves a .gguf file's own blocks and --quantize {quantize} "
                                   f"quantizes a float folder: choose one")
        if kwargs.get("attention", "fast") != "fast" or kwargs.get("native") is False:
            raise ModelSourceError(f"--quantize {quantize} runs on the native forward only (attention 'fast', "
                                   f"native not False)")
        model, tokenizer, tensors = load_quantized_folder(path, quantize, dtype, check=native_unsupported)
        return cls(model, tokenizer, tensors=tensors, **kwargs)

    def release_module_weights(self) -> int:
        """Once the native forward runs the model, drop the transformers modules' own weights (it holds
        what it needs; engine/model/module_weights.py); returns the bytes dropped. Only for a model no one
        else holds (`from_pretrained`'s): a caller's model stays whole, it may be their oracle. The modules
        then cannot run: the runner never calls them while `native` is set."""
        if self.native is None or two_copies():
            return 0
        self._samples = module_weights.weight_samples(self.model)
        return module_weights.release(self.model)

    def weight_samples(self) -> list[tuple[bytes, bytes]]:
        """What the cells' identity fingerprints (engine/core/state/identity.py), as loaded."""
        return self._samples if self._samples is not None else module_weights.weight_samples(self.model)

    def _lora_registry(self) -> LoraRegistry | None:
        if self.native is None:
            return None
        with torch.inference_mode():  # the activations' dtype (a quantized model's are float32)
            dtype = self.native._embed(torch.zeros(1, dtype=torch.int64, device=self.device)).dtype
        return LoraRegistry(Dims.of(self.config, self.native), dtype)

    @property
    def n_cells(self) -> int:
        return self.cache.n_cells

    def forward(self, step: FlatStep) -> torch.Tensor:
        """Run one flat step; return fp32 logits `[len(step.logits_indices), vocab]` for those rows."""
        return self.forward_hidden(step)[0]

    def forward_hidden(self, step: FlatStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, plus the final hidden states `[len(step.hidden_indices), hidden]` (the forward's dtype, after the final
        norm) of the rows `step.hidden_indices` names, in the same forward (None when it names none): the rows
        an embedding request pools (engine/core/embedding.py). Hidden rows need the native forward."""
        if step.hidden_indices is not None and self.native is None:
            raise ValueError("embeddings run on the native forward (Llama, Mistral, Qwen2/3, Gemma 3 families); "
                             "this model runs on the transformers modules")
        plan = self.cache.begin_step(step.seq_ids, step.positions)
        tokens = torch.as_tensor(step.tokens).reshape(-1).to(self.device)
        rows = torch.as_tensor(step.logits_indices, dtype=torch.int64).reshape(-1).to(self.device)
        hidden = None if step.hidden_indices is None else step.hidden_indices.to(self.device)
        try:
            with torch.inference_mode(), drafted_step(step.drafts):
                if self.native is not None:
                    lora = self.loras.step(step.lora, self.device, self.native.fused) if step.lora else None
                    logits, hidden = self.native.forward(self.cache, tokens, plan, rows, lora, hidden_rows=hidden)
                elif step.lora:
                    raise ValueError("LoRA adapters run on the native forward only; this model runs on the "
                                     "transformers modules")
                else:
                    logits = self._hf_forward(tokens, plan, rows)
        except BaseException:
            self.cache.abort_step()
            raise
        self.cache.end_step()
        return logits, hidden

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states that `forward_hidden` returned: the same head, so equal to the logits
        those rows give in a forward (a causal reranker's yes/no scores read them). Native forward only."""
        with torch.inference_mode():
            return self.native.logits(hidden.to(self.device))

    def _hf_forward(self, tokens, plan, rows) -> torch.Tensor:
        """The unmodified transformers model over the planned step (the general path and the oracle)."""
        extra = {"cell_rows": row_gather_for(plan)} if self.gather else {}
        out = self.model(
            input_ids=tokens.reshape(1, -1),
            position_ids=plan.positions.reshape(1, -1).to(self.device),
            attention_mask=_to(build_mask(plan, self.spec), self.device),
            use_cache=True,
            logits_to_keep=rows,
            **{self._cache_kwarg: self.cache},
            **extra,
        )
        return out.logits[0].float()

    def warm_up(self, prefill_tokens: int, draft_tokens: int) -> None:
        """Run the step shapes a server meets first (a prefill of `prefill_tokens`, a lone decode row, a decode
        row with `draft_tokens` drafted ones) on an empty pool, then free their cells: the first request then
        pays no one-time costs (thread pools, scratch buffers, the weights' first pass through each kernel;
        ~35 ms on SmolLM2-135M, more on bigger models), as llama.cpp's server warms up at load. Only on an
        empty pool (before an engine owns it): the pool is left exactly as it was."""
        if self.cache.used_cells():
            raise RuntimeError("warm_up runs on an empty cell pool only (before an engine schedules on it)")
        n = min(prefill_tokens, (self.n_cells - 1) // 2, self.max_model_len // 2)  # n + 1 + rows <= 2n + 1 cells
        if n < 1:
            return
        vocab = self.config.get_text_config().vocab_size
        ids = [(i * 7919 + 1) % vocab for i in range(n)]  # any in-vocabulary ids: only shapes matter here
        try:
            self.run({0: (ids, 0)})
            self.run({0: (ids[:1], n)})
            rows = min(draft_tokens + 1, n)  # a step never holds more rows than the prefill's budget
            drafted = flatten_step({0: (ids[:rows], n + 1)})
            drafted.drafts, drafted.logits_indices = True, torch.arange(rows)  # every row's logits
            self.forward(drafted)
        finally:
            self.cache.seq_rm(0)

    def run(self, chunks: dict[int, tuple[list[int], int]]) -> dict[int, torch.Tensor]:
        """Convenience: `{seq_id: (token_ids, start_pos)}` -> `{seq_id: logits of its last token}`."""
        step = flatten_step(chunks)
        logits = self.forward(step)
        return dict(zip(chunks.keys(), logits))


def _to(mask, device):
    if isinstance(mask, dict):
        return {k: v.to(device) for k, v in mask.items()}
    return mask.to(device)

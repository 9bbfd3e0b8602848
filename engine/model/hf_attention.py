"""How a step's queries attend over cells: the masks handed to an unmodified transformers model.

Two paths that must agree (tests check they do):
- `reference`: every query reads the whole read window `[0, read_len)` with a dense mask. Simple
  and obviously right, but its cost grows with every occupied cell, visible or not.
- `fast` (default): the step reads only the cells some query of the step can see (the plan's
  compacted `read_idx`, built in `CellCache.begin_step`), so cells held by idle sequences, freed
  holes and other conversations' history cost nothing. When each query sees only a small part of
  that window (decoding many sequences: O(B^2 L) dense), each query row instead gathers just its
  own visible cells (`cell_gather`, registered through transformers' `AttentionInterface`; the
  per-row index is `engine.cells.cache.row_gather_for`).

transformers returns an explicit 4D mask untouched, so the mask is the whole integration: bool for
`sdpa`, additive float for `eager` (a bool mask there is silently wrong), and a dict keyed by layer
type for hybrid sliding-window models (Qwen2 with `use_sliding_window`).
"""

import functools
import os
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from engine.cells.plan import RowGather, StepPlan, windowed

ATTENTION_PATHS = ("fast", "reference")


@dataclass(frozen=True)
class MaskSpec:
    """What masks a model needs, read once from its config."""

    additive: bool  # eager and friends add the mask to the scores
    dtype: torch.dtype  # model dtype, for additive masks
    window: int | None  # sliding window applied to every layer (Mistral style)
    layer_windows: dict[str, int | None] | None  # hybrid models: layer type -> window (None = full)


def mask_spec_for(model) -> MaskSpec:
    config = model.config
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", "eager", GATHER):
        raise ValueError(f"attention implementation {impl!r} is not supported over cells: load with 'sdpa' or 'eager'")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    layer_windows = None
    if layer_types is not None and "sliding_attention" in layer_types:
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported over cells")
        layer_windows = {"full_attention": None, "sliding_attention": window}
        window = None
    elif layer_types is not None:
        window = None  # e.g. Qwen2 without use_sliding_window: every layer is full attention
    return MaskSpec(additive=impl == "eager", dtype=model.dtype, window=window, layer_windows=layer_windows)


def build_mask(plan: StepPlan, spec: MaskSpec):
    """The 4D mask `[1, 1, T, C]` (or a dict of them) for this step's plan."""
    if spec.layer_windows is not None:
        return {name: _finish(windowed(plan, w), spec) for name, w in spec.layer_windows.items()}
    return _finish(windowed(plan, spec.window), spec)


def _finish(visible: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    mask = visible[None, None]
    if not spec.additive:
        return mask
    additive = torch.zeros(mask.shape, dtype=spec.dtype)
    return additive.masked_fill_(~mask, torch.finfo(spec.dtype).min)


# ----- per-row gather ------------------------------------------------------------------------------
GATHER = "cell_gather"


def cell_gather_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                          cell_rows: RowGather | None = None, **kwargs):
    """Attention where query row i reads only its own visible cells; falls back to sdpa without a plan."""
    if cell_rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    idx = cell_rows.idx.to(key.device)
    n_tok, width = idx.shape
    n_kv = key.shape[1]
    # [Hkv, T, L, D], contiguous straight out of index_select: batch dims stay collapsible, no copies.
    k = key[0].index_select(1, idx.reshape(-1)).view(n_kv, n_tok, width, -1)
    v = value[0].index_select(1, idx.reshape(-1)).view(n_kv, n_tok, width, -1)
    mask = torch.gather(attention_mask[0, 0], 1, idx)
    valid = cell_rows.valid.to(key.device)
    # One query per row: plain batched matmuls beat sdpa's flash kernel here (q_len 1, tiny heads),
    # especially in bf16. Queries sharing a KV head are grouped, so GQA needs no K/V copy.
    n_heads, head_dim = query.shape[1], query.shape[3]
    scale = scaling if scaling is not None else head_dim**-0.5
    q = query[0].view(n_kv, n_heads // n_kv, n_tok, head_dim).transpose(1, 2)  # [Hkv, T, G, D]
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [Hkv, T, G, L]
    if mask.dtype == torch.bool:
        scores.masked_fill_(~(mask & valid)[None, :, None, :], float("-inf"))
    else:
        scores += mask.float()[None, :, None, :]
        scores.masked_fill_(~valid[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [Hkv, T, G, D]
    return out.permute(1, 0, 2, 3).reshape(1, n_tok, n_heads, head_dim), None  # [1, T, H, D]


@functools.cache
def register_cell_attention() -> None:
    """Make `cell_gather` an attention implementation transformers knows; done once, when the first
    runner that uses it is built (never at import)."""
    # Without it sdpa copies the whole read window per layer (repeat_kv) for GQA models whenever a mask
    # is given; with it sdpa uses enable_gqa, numerically the same and faster on CPU. Read per call.
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    AttentionInterface.register(GATHER, cell_gather_attention)
    AttentionMaskInterface.register(GATHER, sdpa_mask)  # only used when a model builds its own mask (oracle runs)

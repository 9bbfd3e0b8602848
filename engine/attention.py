"""How a step's queries attend over cells: the masks handed to an unmodified transformers model.

Two paths that must agree (tests check they do):
- `reference`: every query reads the whole read window `[0, read_len)` with a dense mask. Simple
  and obviously right, but its cost grows with every occupied cell, visible or not.
- `fast` (default): the step reads only the cells some query of the step can see (the plan's
  compacted `read_idx`, built in `CellCache.begin_step`), so cells held by idle sequences, freed
  holes and other conversations' history cost nothing.

transformers returns an explicit 4D mask untouched, so the mask is the whole integration: bool for
`sdpa`, additive float for `eager` (a bool mask there is silently wrong), and a dict keyed by layer
type for hybrid sliding-window models (Qwen2 with `use_sliding_window`).
"""

import os
from dataclasses import dataclass

import torch

from engine.cells import StepPlan

ATTENTION_PATHS = ("fast", "reference")

# Without it sdpa copies the whole read window per layer (repeat_kv) for GQA models whenever a mask
# is given; with it sdpa uses enable_gqa, numerically the same and faster on CPU.
os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


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
    if impl not in ("sdpa", "eager"):
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
        return {name: _finish(_windowed(plan, w), spec) for name, w in spec.layer_windows.items()}
    return _finish(_windowed(plan, spec.window), spec)


def _windowed(plan: StepPlan, window: int | None) -> torch.Tensor:
    if window is None:
        return plan.visible
    return plan.visible & (plan.key_pos[None, :] > plan.positions[:, None] - window)


def _finish(visible: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    mask = visible[None, None]
    if not spec.additive:
        return mask
    additive = torch.zeros(mask.shape, dtype=spec.dtype)
    return additive.masked_fill_(~mask, torch.finfo(spec.dtype).min)

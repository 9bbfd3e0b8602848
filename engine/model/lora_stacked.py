"""A step's adapters' updates in one pass per fused linear (`Stacked`), whatever the number of adapters.

Split from engine/model/lora.py (the adapters, the registry, the per-adapter path), which builds one `Stacked`
a step; steps of few rows run `KernelStep` (engine/model/lora_kernel.py) instead of its oneDNN ops.
"""

from dataclasses import dataclass

import torch

from engine.model.lora_kernel import KernelStep, usable
from engine.model.native.linear import Linear


@dataclass
class Fused:
    """The step's adapters' updates of one fused linear stacked into two linears packed once (oneDNN, as the
    base's; engine/model/native/linear.py): `a` = their A `[sum R, in]`, `b` = their B side by side `[out, sum R]`
    (gate|up: `b` the gate's rows, `b_up` the up's); `cols[j]`: the segment column j belongs to; `key`: which
    row mask (the segments present and their ranks)."""

    a: Linear
    b: Linear
    b_up: Linear | None
    cols: torch.Tensor
    key: tuple


class Stacked:
    """The step's adapters' updates in one pass per fused linear: `low` = the adapter rows' `x @ A.T` times a
    mask keeping each row's own adapter's columns (times its scale), fused into one oneDNN call; `add` = that
    `@ B.T` plus the linear's output, one more (the residual add's own fused path). Two ops per linear whatever
    the number of adapters (one adapter at scale 1 needs no mask); the extra columns' products are the price:
    `sum R` instead of one adapter's R per row. Where rows of every kind share the step, only the adapter rows
    are read and written (a slice when contiguous, else index_select / index_add_): base rows cost nothing.

    Built once a step (the rows' adapter, the masks); the stacked weights (`fused`) are built on first use per
    layer and linear and cached with the registry while the same adapters step together. Measured on a CPU at
    decode sizes, the ops' count (each a dispatch, an allocation and a parallel region), not their arithmetic,
    is the cost: the per-adapter loop (LayerDeltas without this) runs four per adapter."""

    def __init__(self, segments: list, cache: dict, kernel: torch.dtype | None = None):
        rows = torch.cat([s.rows for s in segments])
        seg = torch.cat([torch.full((len(s.rows),), j) for j, s in enumerate(segments)])
        order = torch.argsort(rows)
        self.rows, self.seg = rows[order], seg[order]
        first, n = int(self.rows[0]), len(self.rows)
        self.span = (first, first + n) if int(self.rows[-1]) - first == n - 1 else None
        self.scale = torch.tensor([s.scale for s in segments])[self.seg]
        self.plain = len(segments) == 1 and segments[0].scale == 1.0  # no mask to apply
        self.segments, self.cache, self.masks = segments, cache, {}
        # `kernel`: the forward's dtype where the fused kernels are on (a step of few rows then runs KernelStep)
        use = kernel is not None and self.rows.device.type == "cpu" and usable(kernel, n)
        self.kernel = KernelStep(segments, self.rows, self.seg, self.scale, cache) if use else None

    def fused(self, layer: int, group: str) -> Fused | None:
        """The stacked weights of the step's adapters targeting `group` in `layer` (None: none targets it)."""
        key = (layer, group)
        if key not in self.cache:
            present = [j for j, s in enumerate(self.segments) if group in s.adapter.layers[layer]]
            self.cache[key] = _fuse([self.segments[j].adapter.layers[layer][group] for j in present], present,
                                    group == "gate_up") if present else None
        return self.cache[key]

    def low(self, fused: Fused, x: torch.Tensor) -> torch.Tensor:
        """`[adapter rows, sum R]`: each adapter row's `x @ A.T` on its own adapter's columns, times its scale."""
        if self.span is None:
            x = x.index_select(0, self.rows)
        elif self.span != (0, x.shape[0]):
            x = x[self.span[0]:self.span[1]]
        if self.plain:
            return fused.a(x)
        mask = self.masks.get(fused.key)
        if mask is None:
            mask = (self.seg[:, None] == fused.cols[None, :]).to(x.dtype) * self.scale[:, None].to(x.dtype)
            self.masks[fused.key] = mask
        return fused.a.times(x, mask)

    def add(self, b: Linear, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` with `t @ B.T` added to the adapter rows."""
        if self.span is None:
            return out.index_add_(0, self.rows, b(t))
        if self.span == (0, out.shape[0]):
            return b.plus(t, out)
        out[self.span[0]:self.span[1]] = b.plus(t, out[self.span[0]:self.span[1]])
        return out


def _fuse(groups: list, present: list[int], split: bool) -> Fused:
    """`groups` (one per segment in `present`) stacked; `split`: B's rows in two halves (gate, up)."""
    cols = torch.cat([torch.full((g.a.shape[0],), j) for j, g in zip(present, groups)])
    b = torch.cat([g.b for g in groups], 1)
    n = b.shape[0] // 2 if split else b.shape[0]
    return Fused(Linear([torch.cat([g.a for g in groups])]), Linear([b[:n]]), Linear([b[n:]]) if split else None,
                 cols, (tuple(present), tuple(g.a.shape[0] for g in groups)))

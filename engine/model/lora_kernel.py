"""A step's LoRA updates through one kernel call per fused linear (`lora_update`, engine/model/kernels/csrc/).

Measured on a 2-core CPU at decode sizes (8 rows over 4 adapters of rank 16 on SmolLM2-135M), the torch ops of
`Stacked` (a shrink with its row mask, an expand fused with the add; on gate|up also the unfused SiLU and
product) cost more than the base model's own linears: each op is a dispatch, an allocation and a parallel
region, while the arithmetic is ~0.2 MFLOP a linear. `lora_update` does the shrink, each row's own adapter's
columns, its scale, the expand and the add in one call; on gate|up also the activation and the product
(the updates land before it), so that MLP costs the two base linears and one call.

Used for steps of up to `KERNEL_ROWS` adapter rows (decodes, small prefills) when the fused kernels are on;
larger steps keep `Stacked`'s oneDNN matmuls, whose arithmetic then dominates. Results equal `Stacked`'s
within float summation order (fp32 sums; one rounding per output instead of one for `x @ A.T` and one for the
sum).
"""

from dataclasses import dataclass

import torch

from engine.model.kernels import build as kernels

KERNEL_ROWS = 64  # adapter rows of a step up to which the kernel runs (its shrink and expand are per row)


def usable(dtype: torch.dtype, n_rows: int) -> bool:
    """Whether a step of `n_rows` adapter rows in `dtype` runs its updates through `lora_update`."""
    return (n_rows <= KERNEL_ROWS and dtype in (torch.float32, torch.bfloat16) and kernels.load()
            and hasattr(torch.ops.cellserve, "lora_update"))


@dataclass
class Plain:
    """The step's adapters' weights of one fused linear as the kernel reads them: `a` their A stacked
    `[sum R, in]`, `bt` their B (scale folded in) transposed and stacked `[sum R, out]` (gate|up: gate's columns
    then up's); `spans[j]`: segment j's columns (absent: it does not target this linear); `key`: which spans."""

    a: torch.Tensor
    bt: torch.Tensor
    spans: dict
    key: tuple


class KernelStep:
    """One step's updates through `lora_update`: each adapter row (`rows`, sorted; `seg`: its segment;
    `scale`: its request's scale) reads its own adapter's columns. The weights (`Plain`) are built on first use
    per layer and linear and kept in `cache` (the registry's, per set of adapters stepping together)."""

    def __init__(self, segments: list, rows: torch.Tensor, seg: torch.Tensor, scale: torch.Tensor, cache: dict):
        self.segments, self.rows, self.seg, self.cache = segments, rows, seg, cache
        self.scale = scale.to(torch.float32).contiguous()
        self.ranges: dict[tuple, torch.Tensor] = {}

    def plain(self, layer: int, group: str) -> Plain | None:
        """The step's adapters' weights of `group` in `layer` (None: none targets it)."""
        key = ("kernel", layer, group)
        if key not in self.cache:
            present = [j for j, s in enumerate(self.segments) if group in s.adapter.layers[layer]]
            self.cache[key] = _plain([self.segments[j].adapter.layers[layer][group] for j in present],
                                     present) if present else None
        return self.cache[key]

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the linear's output for `x`) with each adapter row's update added in place."""
        p = self.plain(layer, group)
        if p is not None:
            torch.ops.cellserve.lora_update(x, out, None, self.rows, self._ranges(p), self.scale, p.a, p.bt, "add")
        return out

    def glu(self, layer: int, h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
        """`act(gate + d_gate) * (up + d_up)` for every row (`gate`, `up`: the base's pre-activations for `h`;
        written into `gate`, which is returned); `act`: "silu", else GELU (tanh)."""
        p = self.plain(layer, "gate_up")
        op = "swiglu" if act == "silu" else "geglu"
        torch.ops.cellserve.lora_update(h, gate, up, self.rows, self._ranges(p), self.scale, p.a, p.bt, op)
        return gate

    def _ranges(self, p: Plain) -> torch.Tensor:
        """`[rows, 2]`: each adapter row's columns of `p` (empty where its adapter does not target it)."""
        r = self.ranges.get(p.key)
        if r is None:
            spans = [p.spans.get(j, (0, 0)) for j in range(len(self.segments))]
            r = self.ranges[p.key] = torch.tensor(spans, dtype=torch.int64)[self.seg].contiguous()
        return r


def _plain(groups: list, present: list[int]) -> Plain:
    spans, col = {}, 0
    for j, g in zip(present, groups):
        spans[j] = (col, col + g.a.shape[0])
        col += g.a.shape[0]
    a = torch.cat([g.a for g in groups]).contiguous()
    bt = torch.cat([g.b for g in groups], 1).t().contiguous()
    return Plain(a, bt, spans, tuple(spans.items()))

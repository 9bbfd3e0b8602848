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
PANEL = 64  # output columns per panel of `Plain.bt` (lora_update.cpp's kChunk)


def usable(dtype: torch.dtype, n_rows: int) -> bool:
    """Whether a step of `n_rows` adapter rows in `dtype` runs its updates through `lora_update`."""
    return (n_rows <= KERNEL_ROWS and dtype in (torch.float32, torch.bfloat16) and kernels.load()
            and hasattr(torch.ops.cellserve, "lora_update"))


@dataclass
class Plain:
    """The step's adapters' weights of one fused linear as the kernel reads them, projection by projection
    (q|k|v: three parts, gate|up: two, else one): `a` their A stacked part by part `[sum R, in]`; `bt` each
    part's B (scale folded in) transposed, `[R_p, W_p]`, in panels of PANEL columns `[W_p / PANEL, R_p, PANEL]`
    (one contiguous read per task of the kernel), the parts one after the other, flat (no zeros: a fused
    group's B is block-diagonal, a third of an adapter's bytes at r 16 on SmolLM2, never read); `parts`
    `[P, 3]`: each part's first row of `a` and its output columns; `spans[j]`: segment j's rows of `a` per part
    (absent: it does not target this linear); `key`: which spans."""

    a: torch.Tensor
    bt: torch.Tensor
    parts: torch.Tensor
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
            torch.ops.cellserve.lora_update(x, out, None, self.rows, self._ranges(p), self.scale, p.a, p.bt, p.parts,
                                            "add")
        return out

    def glu(self, layer: int, h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
        """`act(gate + d_gate) * (up + d_up)` for every row (`gate`, `up`: the base's pre-activations for `h`;
        written into `gate`, which is returned); `act`: "silu", else GELU (tanh)."""
        p = self.plain(layer, "gate_up")
        op = "swiglu" if act == "silu" else "geglu"
        torch.ops.cellserve.lora_update(h, gate, up, self.rows, self._ranges(p), self.scale, p.a, p.bt, p.parts, op)
        return gate

    def _ranges(self, p: Plain) -> torch.Tensor:
        """`[rows, P, 2]`: each adapter row's rows of `p.a` per part (empty where its adapter does not target it)."""
        r = self.ranges.get(p.key)
        if r is None:
            none = ((0, 0),) * p.parts.shape[0]
            spans = [p.spans.get(j, none) for j in range(len(self.segments))]
            r = self.ranges[p.key] = torch.tensor(spans, dtype=torch.int64)[self.seg].contiguous()
        return r


def _plain(groups: list, present: list[int]) -> Plain:
    """`groups` (one per segment in `present`, each a `Group` of the same fused linear) laid out part by part."""
    a, bt, parts, spans, row = [], [], [], {j: [] for j in present}, 0
    for p, (o0, o1, _, _) in enumerate(groups[0].parts):
        parts.append((row, o0, o1))
        blocks = []
        for j, g in zip(present, groups):
            _, _, c0, c1 = g.parts[p]
            a.append(g.a[c0:c1])
            blocks.append(g.b[o0:o1, c0:c1].t())
            spans[j].append((row, row + c1 - c0))
            row += c1 - c0
        bt.append(_panels(torch.cat(blocks)))
    spans = {j: tuple(s) for j, s in spans.items()}
    return Plain(torch.cat(a).contiguous(), torch.cat(bt).contiguous(), torch.tensor(parts, dtype=torch.int64),
                 spans, tuple(spans.items()))


def _panels(bt: torch.Tensor) -> torch.Tensor:
    """`bt` `[R, W]` as PANEL-column panels `[ceil(W / PANEL), R, PANEL]` (the last zero padded), flat."""
    r, w = bt.shape
    padded = torch.nn.functional.pad(bt, (0, -w % PANEL))
    return padded.view(r, -1, PANEL).transpose(0, 1).reshape(-1)

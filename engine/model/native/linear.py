"""Linear: the native forward's projections, fused and prepacked once for oneDNN; one copy of each weight.

Q|K|V and gate|up are concatenated once into one weight each, so a layer runs one matmul per group;
SiLU, the gate*up product and the residual add ride along as fused epilogues. The packed weight is the
only copy kept: many-row calls (prefill, batched decode) give it to oneDNN, and one-row calls (one
sequence decoding) stream the same bytes through `packed_linear` (engine/model/kernels/csrc/packed_linear.cpp),
which reads oneDNN's panel layout directly. Where the kernels cannot read it (another layout on another
CPU), the plain weight stays beside it for `small_linear`, as before (`CELLSERVE_WEIGHT_COPIES=2` forces
that old two-copy layout everywhere: the benchmark's A/B baseline).
On a CPU with AMX, bf16 calls of up to `INVARIANT_ROWS` rows go to `amx_linear` instead (same panels, tile
multiplies): one row as fast as `packed_linear` or faster, 16 rows in about the time of one, and each row
bitwise what it is alone, which is also what oneDNN's AMX kernel gives for it at any row count (measured
equal at 1-16 rows; tests/engine/model/test_linear.py): a drafted row rounds as the one-row decode does
(engine/model/native/rows.py).
"""

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F

from engine.model.kernels import build as kernels
from engine.model.native.rows import INVARIANT_ROWS

log = logging.getLogger("cellserve.native")


def two_copies() -> bool:
    """Whether the plain weights stay beside the packed ones (the layout before one copy; A/B runs only)."""
    return os.environ.get("CELLSERVE_WEIGHT_COPIES") == "2"


class Linear:
    """`y = x @ W.T + b` for 2-D `x`, optionally with a fused epilogue, from a weight packed once.

    oneDNN's packed linear reads the weight in its preferred blocked layout (no per-call reorder)
    and fuses SiLU / a product / a sum into the same pass over the output; without oneDNN support
    for the dtype it is `F.linear` plus the same epilogue in eager ops (same result). With `small`
    on (the fused kernels loaded, `NativeLlama.fused`), one-row calls (a decode step of one sequence)
    go to the one-row kernels instead, at about twice oneDNN's speed there: `packed_linear` over
    `panels` (the packed bytes, as they are), or, where the packed layout is not the one it reads,
    `small_linear` over `parts` (the plain weights, then a second copy).
    Guarantees: one copy of the weight (`packed`, or `weight` when nothing packs it) unless `parts`
    is not None; the same result on every path within float summation order.
    """

    def __init__(self, weights: list[torch.Tensor], bias: torch.Tensor | None = None, gemv: bool = False):
        parts = [w.detach().contiguous() for w in weights]
        w = parts[0] if len(parts) == 1 else torch.cat(parts)
        self.out_features, self.in_features = w.shape  # as nn.Linear has them (GroupLinear sums the parts')
        self.bias = None if bias is None else bias.detach().clone(memory_format=torch.contiguous_format)  # not a view
        self.packed = _pack(w)
        self.panels = None if self.packed is None or two_copies() else packed_panels(w, self.packed)
        # The packed copy replaces the weight, unless one-row calls read it as a GEMV (the LM head without
        # the kernels: `W @ x` streams W's rows once; on AVX2 fp32 about twice as fast as the GEMM kernels
        # at M=1, on AVX512-BF16 in bf16 about half as fast as the packed kernel: timed once, here).
        self.gemv = gemv and self.panels is None and (self.packed is None or _gemv_faster(w, self.packed))
        self.weight = w if self.packed is None or self.gemv else None
        # the plain weights for small_linear: only where the packed bytes cannot serve one row
        keep = self.packed is not None and self.panels is None and _small_kernel(w.dtype)
        self.parts = [w] if self.packed is None else parts if keep else None
        self.amx = self.panels is not None and w.dtype == torch.bfloat16 and amx_available()
        self.small = False

    def is_small(self, x: torch.Tensor) -> bool:
        """Whether this call goes to the few-row kernels: up to `INVARIANT_ROWS` rows on AMX, else one row
        (`packed_linear` and `small_linear` were measured faster at one row only: at 2-4 rows they tie
        oneDNN on MLP weights and lose on the LM head)."""
        return self.small and x.shape[0] <= (INVARIANT_ROWS if self.amx else 1)

    def _small(self, x: torch.Tensor, other: torch.Tensor | None, op: str) -> torch.Tensor:
        if self.amx:
            return torch.ops.cellserve.amx_linear(x, [self.panels], self.out_features, self.bias, other, op)
        if self.panels is not None:
            return torch.ops.cellserve.packed_linear(x, [self.panels], self.out_features, self.bias, other, op)
        return torch.ops.cellserve.small_linear(x, self.parts, self.bias, other, op)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_small(x):
            return self._small(x, None, "none")
        if self.gemv and x.shape[0] == 1 and self.bias is None:
            return torch.mm(self.weight, x.t()).t()
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "swish", [], "")
        return F.silu(F.linear(x, self.weight, self.bias))

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """`linear(x) * other`."""
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "mul")
        return F.linear(x, self.weight, self.bias).mul_(other)

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """`other + linear(x)` (the residual add)."""
        if self.is_small(x):
            return self._small(x, other, "add")
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "add")
        return F.linear(x, self.weight, self.bias).add_(other)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of W (`[len(index), in_features]`) read from the packed panels (needs `panels`): the
        embedding lookup of a tied LM head, which then keeps no table of its own."""
        return panel_rows(self.panels, index, self.in_features)


def small_swiglu(gate: Linear, up: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`silu(gate(x)) * up(x)` for a few rows in one kernel call (both `small`)."""
    if gate.amx and up.amx:
        return torch.ops.cellserve.amx_linear(x, [gate.panels, up.panels], gate.out_features, bias, None, "swiglu")
    if gate.panels is not None and up.panels is not None:
        return torch.ops.cellserve.packed_linear(x, [gate.panels, up.panels], gate.out_features, bias, None, "swiglu")
    return torch.ops.cellserve.small_linear(x, [*gate.parts, *up.parts], bias, None, "swiglu")


def _gemv_faster(w: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether `W @ x` beats the packed kernel at one row for this weight (best of 3 each)."""
    x = torch.randn(1, w.shape[1], dtype=w.dtype)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    with torch.inference_mode():
        return best(lambda: torch.mm(w, x.t())) < best(
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))


@functools.cache
def amx_available() -> bool:
    """Whether `amx_linear` runs here: the kernels built for an AMX CPU, and Linux lets this process use the
    tile registers."""
    return kernels.load() and bool(torch.ops.cellserve.amx_linear_fast())


def _small_kernel(dtype: torch.dtype) -> bool:
    """Whether one-row calls in `dtype` go to the kernels (what `NativeLlama.fused` turns `small` on for)."""
    return kernels.load() and bool(torch.ops.cellserve.small_linear_fast(str(dtype).removeprefix("torch.")))


def panel_width(dtype: torch.dtype) -> tuple[int, int]:
    """(output columns per panel, K block) of oneDNN's packed layout that `packed_linear` reads: float32
    AB16b64a (64 columns, K in 16s), bfloat16 AB16b32a2b (32 columns, K in 32s, pairs interleaved)."""
    return (64, 16) if dtype == torch.float32 else (32, 32)


def expected_panels(w: torch.Tensor) -> torch.Tensor:
    """W `[N, K]` laid out as `packed_linear` reads it: `[ceil(N/width), Kp * width]`, zero padded."""
    n, k = w.shape
    width, kb = panel_width(w.dtype)
    n_pad, k_pad = -(-n // width) * width, -(-k // kb) * kb
    padded = F.pad(w, (0, k_pad - k, 0, n_pad - n))
    if w.dtype == torch.float32:  # [panel][k][64 columns]
        out = padded.view(n_pad // 64, 64, k_pad).transpose(1, 2)
    else:  # [panel][k pair][32 columns][2]
        out = padded.view(n_pad // 32, 32, k_pad // 2, 2).permute(0, 2, 1, 3)
    return out.reshape(n_pad // width, k_pad * width)


def packed_panels(w: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
    """The packed weight's own bytes as `packed_linear`'s panels (sharing its memory), or None: without
    the kernels, in a dtype they do not stream, or where oneDNN chose another layout here (checked once,
    byte for byte, against `expected_panels`; logged once)."""
    if not _small_kernel(w.dtype):
        return None
    expected = expected_panels(w)
    raw = torch.ops.cellserve.packed_bytes(packed)
    if raw.numel() != expected.numel() * expected.element_size():
        panels = None
    else:
        panels = raw.view(w.dtype).view(expected.shape)
        panels = panels if torch.equal(panels, expected) else None
    if panels is None:
        _log_layout_once(w.dtype)
    return panels


_LOGGED: set = set()


def _log_layout_once(dtype: torch.dtype) -> None:
    if dtype not in _LOGGED:
        _LOGGED.add(dtype)
        log.info("oneDNN packs %s weights in a layout packed_linear does not read here: the plain weights stay "
                 "beside the packed ones for one-row calls (2x the linears' bytes)", dtype)


def panel_rows(panels: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `index` of the weight whose panels these are, `[len(index), k]` (a gather: each row's values
    lie one panel row apart)."""
    width, _ = panel_width(panels.dtype)
    index = index.reshape(-1)
    p, c = index // width, index % width
    if panels.dtype == torch.float32:
        return panels.view(panels.shape[0], -1, 64)[p, :k, c]
    return panels.view(panels.shape[0], -1, 32, 2)[p, :, c, :].reshape(len(index), -1)[:, :k]


def _pack(w: torch.Tensor) -> torch.Tensor | None:
    if w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if w.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None  # no AVX512-BF16: oneDNN refuses; eager bf16 matmul is the fallback
    if w.dtype not in (torch.float32, torch.bfloat16):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, None)
    except RuntimeError:
        return None


def cat_bias(*mods) -> torch.Tensor | None:
    """The biases of linears whose outputs are concatenated (zeros for those without), or None."""
    if all(m.bias is None for m in mods):
        return None
    return torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features, dtype=m.weight.dtype)
                      for m in mods])


def fused_linear(*mods, gemv: bool = False) -> Linear:
    """One `Linear` computing the concatenated outputs of the given `nn.Linear`s."""
    return Linear([m.weight for m in mods], cat_bias(*mods), gemv)

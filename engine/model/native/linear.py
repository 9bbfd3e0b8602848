"""Linear: the native forward's projections, fused and prepacked once for oneDNN, or streamed in place by
the one-row kernel (`small_linear`) when one sequence decodes.

Q|K|V and gate|up are concatenated once into one weight each, so a layer runs one matmul per group;
SiLU, the gate*up product and the residual add ride along as fused epilogues.
"""

import time

import torch
import torch.nn.functional as F


class Linear:
    """`y = x @ W.T + b` for 2-D `x`, optionally with a fused epilogue, from a weight packed once.

    oneDNN's packed linear reads the weight in its preferred blocked layout (no per-call reorder)
    and fuses SiLU / a product / a sum into the same pass over the output; without oneDNN support
    for the dtype it is `F.linear` plus the same epilogue in eager ops (same result). With `small`
    on (the fused kernels loaded, `NativeLlama.fused`), one-row calls (a decode step of one sequence)
    go to `torch.ops.cellserve.small_linear` instead, which streams `parts` (the model's own weights,
    read in place) once at about twice oneDNN's speed at one row (engine/model/kernels/csrc/small_linear.cpp).
    """

    def __init__(self, weights: list[torch.Tensor], bias: torch.Tensor | None = None, gemv: bool = False):
        self.parts = [w.detach().contiguous() for w in weights]
        w = self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)
        self.out_features, self.in_features = w.shape  # as nn.Linear has them (GroupLinear sums the parts')
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed = _pack(w)
        # The packed copy replaces the weight, unless one-row calls read it as a GEMV (the LM head:
        # `W @ x` streams W's rows once; on AVX2 fp32 about twice as fast as the GEMM kernels at
        # M=1, on AVX512-BF16 in bf16 about half as fast as the packed kernel: timed once, here).
        self.gemv = gemv and (self.packed is None or _gemv_faster(w, self.packed))
        self.weight = w if self.packed is None or self.gemv else None
        self.small = False

    def is_small(self, x: torch.Tensor) -> bool:
        """Whether this call goes to the small-row kernel (measured faster at one row only: at 2-4
        rows it ties oneDNN on MLP weights and loses on the LM head)."""
        return self.small and x.shape[0] == 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_small(x):
            return torch.ops.cellserve.small_linear(x, self.parts, self.bias, None, "none")
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
            return torch.ops.cellserve.small_linear(x, self.parts, self.bias, other, "add")
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "add")
        return F.linear(x, self.weight, self.bias).add_(other)


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

"""MoeBlock: the native forward's mixture-of-experts feed-forward (Qwen3-MoE, Mixtral; OLMoE's block too).

A router (`[E, H]` linear) scores every row; softmax (float32) -> the top k experts -> renormalised over
the chosen k when `norm_topk_prob` (Qwen3-MoE; Mixtral always, which is softmax over the chosen logits)
-> each chosen expert is a SwiGLU MLP `down(silu(gate(h)) * up(h))`, its output weighted and summed.

How a flat step runs: the step's (row, expert) pairs are sorted by expert once (one argsort, no Python
loop over rows); each ACTIVE expert then runs once over all its rows (one gate|up and one down call per
expert: a GEMM for many rows, the one-row kernels at one row), and its weighted rows are added back with
`index_add_`. Experts no row chose are never touched, so at one row only the k chosen experts' bytes are
read: a decode step streams the active parameters, not the file. Each row's sum runs over its experts in
ascending expert id whatever the other rows are (as transformers' `index_add_` loop does), so a row
computes as alone wherever the expert kernels do (engine/model/native/rows.py).
K-quant experts at up to `FUSED_ROWS` rows (or `FUSED_PAIRS` pairs an expert) take one `quant_moe` call instead (csrc/quant_experts.cpp: the same
grouping in C++, every chosen expert on the row kernel, the weighted sum fused): bitwise the loop above over
the row kernel, without its per-expert Python and kernel calls (a decode step of the Qwen3-30B-A3B-scaled file:
1.46x; docs/performance.md).

Experts are held two ways, one copy each:
- `FloatExperts`: the transformers model's stacked 3-D parameters (`gate_up_proj` [E, 2I, H],
  `down_proj` [E, H, I]) as they are; an expert is a view, multiplied by `F.linear`.
- `QuantExperts`: a GGUF file's `ffn_{gate,up,down}_exps` tensors, each expert a contiguous slice of the
  file's blocks repacked per expert (engine/loader/gguf_tensors.py) and run on the same quantized linears
  as a dense layer (`linear_of`: quant_tiles for Q8_0/Q4_0/Q4_1, the row kernel / GEMM for the K-quants).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.loader.gguf_tensors import BLOCK_WEIGHTS, KIND_IDS, QuantWeight
from engine.model.native.linear import Linear
from engine.model.native.quant import QuantLinear, _fast, linear_of
from engine.model.native.rows import must_match_alone

# Up to this many rows a step (decode of up to 32 sequences, speculative verification) runs the experts in one
# `quant_moe` call, each expert's rows on the row kernel; more (prefill) expert by expert, where each expert's
# rows take the GEMM or bf16 tiles (faster from ~12-16 rows an expert: engine/model/native/quant.py)
FUSED_ROWS = 32
# ... and so does a larger step whose (row, expert) pairs are at most this many an expert on average: a prompt's
# prefill on a file of many experts (Qwen3-MoE Q4_K_M, 32 experts, top 4, 2 threads, 2026-12-08: a 64-token
# prompt, 8 pairs an expert, 350-430 -> 223-267 ms; the per-expert loop's Python, index_select/index_add and
# GEMM packing cost more than the row kernel loses on so few rows)
FUSED_PAIRS = 10


def is_moe(mlp) -> bool:
    """Whether a transformers decoder layer's `mlp` is a routed mixture of experts (router `gate` + `experts`)."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def moe_of(mlp) -> "MoeBlock | None":
    """The native block of a transformers layer's `mlp` when it is a mixture of experts, else None (a dense MLP)."""
    return MoeBlock.of_module(mlp) if is_moe(mlp) else None


def gguf_moe(weights: dict, mlp) -> dict:
    """A GGUF layer's weights (quant.layer_weights) with its MoE tensors (`moe`, when the block has a router) made
    the layer's MLP piece, routed as the skeleton's transformers block `mlp` says."""
    if "moe" not in weights:
        return weights
    return {k: v for k, v in weights.items() if k != "moe"} | {"mlp": MoeBlock.of_gguf(weights["moe"], mlp)}


def moe_unsupported(mlp) -> str | None:
    """Why `MoeBlock` cannot reproduce this transformers block (None when it can, or when it is no MoE block)."""
    name = type(mlp).__name__
    if not is_moe(mlp):
        return None
    if hasattr(mlp, "shared_expert"):
        return f"{name} has a shared expert"
    experts = mlp.experts
    if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False):
        return f"{name}'s experts are biased or transposed"
    if not all(hasattr(experts, a) for a in ("gate_up_proj", "down_proj")):
        return f"{name}'s experts are not stacked gate_up_proj/down_proj tensors"
    act = getattr(experts, "act_fn", None)
    if act is not None and type(act).__name__ not in ("SiLU", "SiLUActivation"):
        return f"{name}'s experts use {type(act).__name__}, not SiLU"
    return None


@dataclass
class Routing:
    """A step's (row, expert) pairs grouped by expert: `rows[bounds[i]:bounds[i + 1]]` are the rows that chose
    `experts[i]` (ascending expert ids), weighted by `weights` over the same span."""

    rows: torch.Tensor  # [T * k] int64
    weights: torch.Tensor  # [T * k] the router weight of each pair (the activations' dtype)
    experts: list[int]
    bounds: list[int]


def top_experts(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, chosen [T, k] int64): the top `top_k` experts of each row of router `logits`
    [T, E], as transformers picks them: softmax in float32, top k, renormalised over the k when `norm_topk_prob`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype) -> Routing:
    """`top_experts` grouped by expert, the weights cast to `dtype` (transformers casts them so)."""
    weights, chosen = top_experts(logits, top_k, norm_topk_prob)
    if logits.shape[0] == 1:  # one row (a decode step): its k experts in ascending order, no grouping
        chosen, order = chosen[0].sort()
        return Routing(torch.zeros(top_k, dtype=torch.int64), weights[0, order].to(dtype), chosen.tolist(),
                       list(range(top_k + 1)))
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert; within an expert, by row
    counts = torch.bincount(flat, minlength=logits.shape[1])
    active = torch.nonzero(counts).reshape(-1)
    ends = torch.cumsum(counts[active], 0)
    bounds = [0, *ends.tolist()]
    return Routing(order // top_k, weights.reshape(-1)[order].to(dtype), active.tolist(), bounds)


class StackedWeight:
    """A float expert stack [E, N, K] as what walks a layer's `linears()` sees a linear (byte counts, the `small`
    switch): the tensor as it is, no packed copy beside it."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.parts, self.packed, self.bias, self.small = weight, None, None, None, False
        self.out_features, self.in_features = weight.shape[0] * weight.shape[1], weight.shape[2]


class FloatExperts:
    """A transformers model's stacked experts, as they are (views of its parameters: one copy)."""

    def __init__(self, experts):
        self.gate_up = experts.gate_up_proj.detach()  # [E, 2I, H]
        self.down_w = experts.down_proj.detach()  # [E, H, I]
        self.count, self.inter = self.gate_up.shape[0], self.gate_up.shape[1] // 2

    def linears(self) -> list:
        return [StackedWeight(self.gate_up), StackedWeight(self.down_w)]

    def fused(self, rows: int, top_k: int = 1) -> bool:
        return False

    def swiglu(self, e: int, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.gate_up[e])
        return F.silu(y[:, : self.inter]).mul_(y[:, self.inter :])

    def down(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.down_w[e])


class QuantExperts:
    """A GGUF file's experts: per expert a [gate; up] linear with its swiglu and a down linear, over the
    expert's own slice of the file's blocks (`QuantWeight`s or float tensors; `linear_of` picks the kernels).

    K-quant experts (one kind per projection) are stacked: `stacked` holds one weight of E [gate_e; up_e] and
    one of the E downs, and each expert's linear reads its rows of them (views: one copy), so a step of few rows
    runs every chosen expert in one `quant_moe` call (`fused`, `moe`) and more rows expert by expert."""

    def __init__(self, gate: list, up: list, down: list):
        if not len(gate) == len(up) == len(down):
            raise ValueError(f"a MoE block needs as many gate, up and down experts; got {len(gate)}, {len(up)}, "
                             f"{len(down)}")
        self.count = len(gate)
        self.stacked = _stack(gate, up, down)
        if self.stacked is None:
            self.gate_up = [linear_of([g, u], swiglu=True) for g, u in zip(gate, up)]
            self.down_lin = [linear_of([d]) for d in down]
        else:
            gu, dn = self.stacked
            a, b = gu.shape[0] // self.count, dn.shape[0] // self.count
            self.gate_up = [QuantLinear(_rows(gu, e * a, (e + 1) * a), parts=2) for e in range(self.count)]
            self.down_lin = [QuantLinear(_rows(dn, e * b, (e + 1) * b)) for e in range(self.count)]

    def fused(self, rows: int, top_k: int = 1) -> bool:
        """Whether a step of `rows` rows, `top_k` experts a row, runs on `quant_moe` (stacked K-quants, the kernels
        on, VNNI: where each expert's linear would take the row kernel, or its rows are few: `FUSED_PAIRS`)."""
        few = rows <= FUSED_ROWS or rows * top_k <= FUSED_PAIRS * self.count
        return (self.stacked is not None and few and self.gate_up[0].small
                and hasattr(torch.ops.cellserve, "quant_moe") and _fast()[0])

    def moe(self, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights * expert_chosen(h) per row, every chosen expert in one kernel call."""
        gu, dn = self.stacked
        return torch.ops.cellserve.quant_moe(h.float().contiguous(), chosen.contiguous(), weights.float().contiguous(),
                                             gu.tensors(), KIND_IDS[gu.kind], dn.tensors(), KIND_IDS[dn.kind],
                                             self.count).to(h.dtype)

    def linears(self) -> list:
        return [*self.gate_up, *self.down_lin]

    def swiglu(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.gate_up[e].swiglu(x)

    def down(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return self.down_lin[e](h)


class MoeBlock:
    """`sum_k w_k * expert_k(h)` per row, the experts each row's router chose (module docstring).

    Guarantees: transformers' routing exactly (same softmax, top-k, renormalisation and weight dtype); each
    active expert runs once a step over all its rows; experts no row chose are not read."""

    def __init__(self, router, experts, top_k: int, norm_topk_prob: bool):
        self.router, self.experts = router, experts
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        if not 0 < top_k <= experts.count:
            raise ValueError(f"a MoE block of {experts.count} experts cannot route to the top {top_k}")

    @staticmethod
    def of_module(mlp) -> "MoeBlock":
        """From a transformers sparse MoE block (its parameters as they are)."""
        why = moe_unsupported(mlp)
        if why:
            raise ValueError(f"no native MoE block: {why}")
        return MoeBlock(Linear([mlp.gate.weight]), FloatExperts(mlp.experts), *routing_of(mlp))

    @staticmethod
    def of_gguf(t: dict, mlp) -> "MoeBlock":
        """From one GGUF block's tensors (`ffn_gate_inp`, `ffn_{gate,up,down}_exps`, each a list of per-expert
        weights), routed as the skeleton's block `mlp` says."""
        w = t.pop("ffn_gate_inp.weight")  # llama.cpp keeps routers in F32: the float linear, as a model's own
        router = Linear([w]) if isinstance(w, torch.Tensor) and w.dtype == torch.float32 else linear_of([w])
        experts = QuantExperts(*(t.pop(f"ffn_{p}_exps.weight") for p in ("gate", "up", "down")))
        if t:
            raise ValueError(f"a GGUF MoE block has tensors this forward does not read: {sorted(t)}")
        return MoeBlock(router, experts, *routing_of(mlp))

    def linears(self) -> list:
        return [self.router, *self.experts.linears()]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E]; in a step whose rows must compute as alone, one row at a time (a float
        linear sums one row in another order than several: the top-k must not flip with the company)."""
        if not must_match_alone(h.shape[0]) or h.shape[0] == 1:
            return self.router(h)
        return torch.cat([self.router(h[i:i + 1].clone()) for i in range(h.shape[0])])

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output [T, H] for normed hidden states `h` [T, H], plus `residual` when given (added
        last, as transformers adds it: `residual + sum of the experts`)."""
        if self.experts.fused(h.shape[0], self.top_k):
            weights, chosen = top_experts(self.logits(h), self.top_k, self.norm_topk_prob)
            out = self.experts.moe(h, chosen, weights.to(h.dtype))
            return out if residual is None else residual + out
        r = route(self.logits(h), self.top_k, self.norm_topk_prob, h.dtype)
        out = torch.zeros_like(h)
        for e, a, b in zip(r.experts, r.bounds, r.bounds[1:]):
            rows = r.rows[a:b]
            x = h if b - a == h.shape[0] else h.index_select(0, rows)  # one row (decode): no copy
            y = self.experts.down(e, self.experts.swiglu(e, x))
            out.index_add_(0, rows, y.mul_(r.weights[a:b, None]).to(out.dtype))
        return out if residual is None else residual + out


def _stack(gate: list, up: list, down: list) -> "tuple[QuantWeight, QuantWeight] | None":
    """([gate_0; up_0; gate_1; up_1; ...], [down_0; down_1; ...]) as two weights when the experts are K-quants of
    one kind per projection (what `quant_moe` reads), else None."""
    def one_kind(ws: list) -> bool:
        return all(isinstance(w, QuantWeight) for w in ws) and len({w.kind for w in ws}) == 1 \
            and BLOCK_WEIGHTS[ws[0].kind] == 256

    if not (one_kind(gate + up) and one_kind(down)):
        return None
    return QuantWeight.cat([w for pair in zip(gate, up) for w in pair]), QuantWeight.cat(down)


def _rows(w: QuantWeight, r0: int, r1: int) -> QuantWeight:
    """Rows [r0, r1) of `w`, views of its arrays (contiguous: rows of row-major arrays)."""
    return QuantWeight(w.kind, *(None if t is None else t[r0:r1] for t in w.fields()))


def routing_of(mlp) -> tuple[int, bool]:
    """(top_k, norm_topk_prob) of a transformers sparse MoE block (Mixtral's router always renormalises)."""
    gate = mlp.gate
    top_k = getattr(gate, "top_k", None) or getattr(mlp, "top_k", None)
    if top_k is None:
        raise ValueError(f"{type(mlp).__name__} names no top_k")
    return int(top_k), bool(getattr(gate, "norm_topk_prob", True))

"""A native forward for the Llama family (Llama, Mistral, Qwen2): transformers' math in fewer ops.

An unmodified transformers decoder layer runs ~50 tensor ops and a dozen Python modules per layer;
on a small CPU most of a decode step is that overhead (every op dispatches, allocates and opens an
OpenMP region), not arithmetic. `NativeLlama` runs the same model from the same weights with:
- fused Q|K|V and gate|up projections, prepacked once for oneDNN where torch can (fp32; bf16 on
  CPUs with AVX512-BF16), with SiLU, the gate*up product and the residual adds fused into the
  matmuls as oneDNN post-ops;
- RoPE applied to Q and K together from one cos/sin table per step (not per layer);
- K/V written straight into the cell pools and attention read straight from them
  (`Attend`, below): decoding rows read their own visible cells, with the mask folded into an
  additive bias built once per step for all layers;
- with the fused CPU kernels (`engine/model/kernels/build.py`, built once; eager ops when they cannot be built):
  RMSNorm in one pass, RoPE + the K/V pool write in one pass, and decode attention reading the
  cells in place, so a layer runs 9 ops instead of ~35; and at one row (one sequence decoding)
  every linear streams the model's own weights through `small_linear` (about twice oneDNN's speed
  there), with gate|up and SiLU*up in one call, so a layer runs 8.

The transformers modules stay the general path for every other architecture and the oracle the
tests compare this one against (fp32: same logits within 1e-4, same greedy tokens).

How the queries read the cell pools is decided once a step for every layer (`Attend`).
A step is one or more parts, each a set of query rows and the pool cells they read:
- `cells` (with the fused kernels, `engine/model/kernels/build.py`): each one-row (decoding) query reads its own
  visible cells in place from the pools (`torch.ops.cellserve.cell_attention`, no copy);
- `gather` (without them): each one-row query copies its own visible cells out of the pools and
  attends by batched matmuls with an additive bias `[Hkv*t, G, L]`;
- `dense` (without them; one row, or rows that each see most of the window): every row reads the
  step's window (`cells` [C] or the prefix [0, read_len)) with a bias `[1, T*G, C]`;
- `sdpa`: one prefill chunk (a sequence bringing several rows) reads only the cells its own rows can
  see, through torch's tiled sdpa kernel with a bool mask. Reading the whole step window instead
  would cost its rows x every cell of every sequence in the step (with 32 1,000-token conversations,
  32x the attention work of reading its own history), and gathering per row would copy its history
  once per row.
A step without a prefill chunk is one part (mode `cells`, `gather` or `dense`); a step with one is
mode `split`: one `sdpa` part per chunk and one `cells` or `gather` part for all one-row queries.
"""

import time
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from engine.cells.cache import CellCache
from engine.cells.plan import RowGather, StepPlan, gather_rows, row_gather_for, windowed
from engine.model.hf_attention import MaskSpec
from engine.model.kernels import build as kernels

NATIVE_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def native_unsupported(model) -> str | None:
    """Why `NativeLlama` cannot run `model` (None when it can): anything it does not reproduce exactly."""
    name = type(model).__name__
    if name not in NATIVE_ARCHS:
        return f"{name} is not one of {NATIVE_ARCHS}"
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    layer = model.model.layers[0]
    extra = {"q_norm", "k_norm"} & set(dict(layer.self_attn.named_children()))
    if extra:
        return f"attention has {sorted(extra)}"
    if model.device.type != "cpu":
        return "the native forward is written for CPU"
    return None


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


def _cat_bias(*mods) -> torch.Tensor | None:
    """The biases of linears whose outputs are concatenated (zeros for those without), or None."""
    if all(m.bias is None for m in mods):
        return None
    return torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features, dtype=m.weight.dtype)
                      for m in mods])


def _linear(*mods, gemv: bool = False) -> Linear:
    """One `Linear` computing the concatenated outputs of the given `nn.Linear`s."""
    return Linear([m.weight for m in mods], _cat_bias(*mods), gemv)


class _Layer:
    """One decoder layer's fused weights and the window its attention uses."""

    def __init__(self, layer, window: int | None):
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1, self.eps1 = layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon
        self.ln2, self.eps2 = layer.post_attention_layernorm.weight.detach(), layer.post_attention_layernorm.variance_epsilon
        self.qkv = _linear(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = _linear(attn.o_proj)
        self.gate, self.up = _linear(mlp.gate_proj), _linear(mlp.up_proj)
        self.gate_up_bias = _cat_bias(mlp.gate_proj, mlp.up_proj)
        self.down = _linear(mlp.down_proj)
        self.scale = attn.scaling
        self.window = window

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o, self.gate, self.up, self.down]

    def swiglu(self, h: torch.Tensor) -> torch.Tensor:
        """`silu(gate(h)) * up(h)`: one small-row kernel call at one row, else two fused oneDNN calls."""
        if self.gate.is_small(h):
            return torch.ops.cellserve.small_linear(h, [*self.gate.parts, *self.up.parts], self.gate_up_bias,
                                                    None, "swiglu")
        return self.up.times(h, self.gate.silu(h))


class NativeLlama:
    """The Llama-family forward over a `CellCache`, built from (and sharing the math of) an HF model.

    Guarantees: the same logits as the transformers modules over the same cells (fp32 within
    float rounding; the equivalence tests check it against a cacheless forward), using the same
    K/V pools, so the cache verbs, forks and the reference path all see one pool.
    """

    def __init__(self, model, spec: MaskSpec):
        reason = native_unsupported(model)
        if reason:
            raise ValueError(f"no native forward: {reason}")
        cfg = model.config
        base = model.model
        types = getattr(cfg, "layer_types", None)
        if spec.layer_windows is not None:
            windows = [spec.layer_windows[types[i]] for i in range(len(base.layers))]
        else:
            windows = [spec.window] * len(base.layers)
        self.layers = [_Layer(layer, w) for layer, w in zip(base.layers, windows)]
        self.windows = sorted(set(windows), key=lambda w: -1 if w is None else w)
        self.embed = base.embed_tokens.weight.detach()
        self.norm, self.norm_eps = base.norm.weight.detach(), base.norm.variance_epsilon
        self.head = _linear(model.lm_head, gemv=True)
        self.rotary = base.rotary_emb
        attn = base.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads or self.n_heads
        self.dtype = model.dtype
        # the fused kernels when they load (fp32 and bf16); tests flip this to check both paths agree
        self.fused = self.dtype in (torch.float32, torch.bfloat16) and kernels.load()

    @property
    def fused(self) -> bool:
        return self._fused

    @fused.setter
    def fused(self, on: bool) -> None:
        self._fused = on
        small = on and torch.ops.cellserve.small_linear_fast(str(self.dtype).removeprefix("torch."))
        for linear in [self.head, *(lin for layer in self.layers for lin in layer.linears())]:
            linear.small = small

    def forward(self, cache: CellCache, tokens: torch.Tensor, plan: StepPlan, rows: torch.Tensor) -> torch.Tensor:
        """Logits `[len(rows), vocab]` (fp32) of the given rows of this planned step."""
        x = F.embedding(tokens, self.embed)  # [T, H]
        cos, sin = self.rotary(x, plan.positions[None])
        attend = Attend(plan, self.n_kv, self.n_heads // self.n_kv, self.windows, x.device, self.fused)
        rope = (cos[0], sin[0]) if self.fused else _eager_rope(cos, sin, self.head_dim)
        for layer, pools in zip(self.layers, cache.layers):
            if not pools.is_initialized:  # the pools take their shape from the first K/V they see
                kv = x.new_zeros(1, self.n_kv, 1, self.head_dim)
                pools.lazy_initialization(kv, kv)
            x = self._layer(layer, x, pools, rope, plan.kv_cells, attend)
        x = self._norm(x.index_select(0, rows), self.norm, self.norm_eps)
        return self.head(x).float()

    def _layer(self, layer: _Layer, x, pools, rope, cells, attend) -> torch.Tensor:
        qkv = layer.qkv(self._norm(x, layer.ln1, layer.eps1))
        q = self._rope_store(qkv, rope, pools, cells)
        x = layer.o.plus(attend(q, pools.keys, pools.values, layer.scale, layer.window), x)
        h = self._norm(x, layer.ln2, layer.eps2)
        return layer.down.plus(layer.swiglu(h), x)

    def _norm(self, x, weight, eps) -> torch.Tensor:
        if self.fused:
            return torch.ops.cellserve.rms_norm(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def _rope_store(self, qkv, rope, pools, cells) -> torch.Tensor:
        """RoPE on Q and K, K and V written into their cells; returns Q `[T, Hq, D]`."""
        n_q, n_kv = self.n_heads, self.n_kv
        if self.fused:
            return torch.ops.cellserve.rope_store(qkv, *rope, pools.keys, pools.values, cells, n_q, n_kv)
        n_tok, head_dim = qkv.shape[0], self.head_dim
        cos, sin = rope
        qk = qkv[:, : (n_q + n_kv) * head_dim].view(n_tok, n_q + n_kv, head_dim)
        qk = torch.addcmul(qk * cos, qk.roll(head_dim // 2, -1), sin)  # RoPE on Q and K at once
        v = qkv[:, (n_q + n_kv) * head_dim :].view(n_tok, n_kv, head_dim)
        pools.keys.index_copy_(2, cells, qk[:, n_q:].transpose(0, 1)[None])
        pools.values.index_copy_(2, cells, v.transpose(0, 1)[None])
        return qk[:, :n_q]


def _eager_rope(cos: torch.Tensor, sin: torch.Tensor, head_dim: int):
    """cos `[T, 1, D]` and sin `[T, 1, D]` with rotate_half's sign folded in (for `roll`)."""
    half = head_dim // 2
    return cos[0, :, None, :], torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)[:, None, :]


# ----- attention over the pools ------------------------------------------------------------------
@dataclass
class _Part:
    """Some rows of a step, the pool cells they read (None: the prefix [0, read_len)) and their mask
    per attention window, in the form `kind` needs (see the module docstring)."""

    kind: str
    rows: slice | torch.Tensor
    cells: torch.Tensor | None
    masks: dict
    width: int | None = None  # gather: cells per row


class Attend:
    """One step's attention plan (see the module docstring); `__call__` runs it for one layer."""

    def __init__(self, plan: StepPlan, n_kv: int, group: int, windows, device, fused: bool = False):
        n_tok = plan.visible.shape[0]
        self.n_tok, self.n_kv, self.group, self.read_len = n_tok, n_kv, group, plan.read_len
        ids = plan.seq_ids
        bounds = [0, *((ids[1:] != ids[:-1]).nonzero().flatten() + 1).tolist(), n_tok]
        seen = {w: windowed(plan, w) for w in windows}  # [T, C] visibility per attention window
        if len(bounds) - 1 < n_tok:  # some sequence brings several rows: a prefill chunk
            self.mode = "split"
            self.parts = _split_parts(plan, seen, bounds, n_kv, group, device, fused)
            return
        everyone = slice(None)
        gather = None if fused else row_gather_for(plan, max_tokens=None)
        if fused:
            part = _cell_part(plan, seen, everyone, device)
        elif gather is not None:
            part = _gather_part(plan, seen, gather, everyone, n_kv, group, device)
        else:
            masks = {w: _additive(m).repeat_interleave(group, 0)[None].to(device) for w, m in seen.items()}
            part = _Part("dense", everyone, plan.read_idx, masks)
        self.mode, self.parts = part.kind, [part]

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window) -> torch.Tensor:
        """q `[T, Hq, D]` -> attention output `[T, Hq*D]`."""
        if self.mode != "split":  # one part, every row
            return self._run(self.parts[0], q, keys, values, scale, window)
        out = q.new_empty(self.n_tok, q.shape[1] * q.shape[2])
        for part in self.parts:
            out[part.rows] = self._run(part, q[part.rows], keys, values, scale, window)
        return out

    def _run(self, part: _Part, q, keys, values, scale, window) -> torch.Tensor:
        """One part's rows of q `[t, Hq, D]` -> `[t, Hq*D]`."""
        mask = part.masks[window]
        if part.kind == "cells":
            return torch.ops.cellserve.cell_attention(q.contiguous(), keys, values, part.cells, mask, scale)
        k, v = self._read(keys, part.cells), self._read(values, part.cells)
        if part.kind == "sdpa":
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                               scale=scale, enable_gqa=self.group > 1)
            return o[0].transpose(0, 1).reshape(o.shape[2], -1)
        return self._bmm(q, k, v, mask, scale, part.width)

    def _read(self, pool: torch.Tensor, cells: torch.Tensor | None) -> torch.Tensor:
        """The K or V rows read, `[Hkv, t*L or C, D]`."""
        if cells is None:
            return pool[0, :, : self.read_len]
        return pool[0].index_select(1, cells)

    def _bmm(self, q, k, v, bias, scale, width):
        """Scores, softmax and values by batched matmuls: per row over `width` gathered cells, or every
        row over the same window (`width` None)."""
        n_tok, n_kv, group, head_dim = q.shape[0], self.n_kv, self.group, q.shape[-1]
        dtype = q.dtype
        if dtype != torch.float32 and n_tok == 1:
            # One decoding row: torch's CPU bf16 bmm builds a oneDNN primitive for every new key
            # length (every step), ~10x the work; fp32 copies of so few rows cost less. With more
            # rows the bf16 kernels win (measured: 32 rows 2.3x slower in fp32).
            q, k, v = q.float(), k.float(), v.float()
        q = q.reshape(n_tok, n_kv, group, head_dim).transpose(0, 1)  # [Hkv, T, G, D]
        if width is not None:
            q = q.reshape(n_kv * n_tok, group, head_dim)
            k = k.view(n_kv * n_tok, width, head_dim)
            v = v.view(n_kv * n_tok, width, head_dim)
        else:
            q = q.reshape(n_kv, n_tok * group, head_dim)
        probs = _softmax_scores(q, k, bias, scale).to(v.dtype)
        out = torch.bmm(probs, v)  # [Hkv*T, G, D] or [Hkv, T*G, D]
        return out.view(n_kv, n_tok, group, head_dim).transpose(0, 1).reshape(n_tok, -1).to(dtype)


def _split_parts(plan: StepPlan, seen: dict, bounds: list[int], n_kv: int, group: int, device,
                 fused: bool) -> list[_Part]:
    """One sdpa part per multi-row chunk (rows `bounds[i]:bounds[i+1]`), one part for all one-row ones."""
    parts, singles = [], []
    read_idx = None if plan.read_idx is None else plan.read_idx.cpu()
    for a, b in pairwise(bounds):
        if b - a == 1:
            singles.append(a)
            continue
        cols = plan.visible[a:b].any(0).nonzero().flatten()
        cells = cols if read_idx is None else read_idx[cols]
        masks = {w: mask[a:b, cols][None, None].to(device) for w, mask in seen.items()}
        parts.append(_Part("sdpa", slice(a, b), cells.to(device), masks))
    if singles:
        rows = torch.tensor(singles)
        part = (_cell_part(plan, seen, rows, device) if fused else
                _gather_part(plan, seen, gather_rows(plan.visible[rows]), rows, n_kv, group, device))
        part.rows = rows.to(device)
        parts.append(part)
    return parts


def _row_cells(plan: StepPlan, seen: dict, gather: RowGather, rows):
    """The pool cells `[t, L]` the given one-row queries read (padded) and their biases `[t, L]` per window."""
    idx = gather.idx if plan.read_idx is None else plan.read_idx.cpu()[gather.idx]
    return idx, {w: _additive(torch.gather(mask[rows], 1, gather.idx) & gather.valid) for w, mask in seen.items()}


def _cell_part(plan: StepPlan, seen: dict, rows, device) -> _Part:
    """The fused kernel's part: cells `[t, L]` read in place, biases `[t, L]`."""
    idx, bias = _row_cells(plan, seen, gather_rows(plan.visible[rows]), rows)
    return _Part("cells", rows, idx.to(device), {w: b.to(device) for w, b in bias.items()})


def _gather_part(plan: StepPlan, seen: dict, gather: RowGather, rows, n_kv: int, group: int, device) -> _Part:
    """The eager part: cells `[t*L]` copied out, biases expanded to `[Hkv*t, G, L]` for the bmm."""
    idx, bias = _row_cells(plan, seen, gather, rows)
    n_tok, width = idx.shape
    masks = {w: b[None, :, None, :].expand(n_kv, n_tok, group, width).reshape(n_kv * n_tok, group, width).to(device)
             for w, b in bias.items()}
    return _Part("gather", rows, idx.reshape(-1).to(device), masks, width)


def _softmax_scores(q, k, bias, scale):
    if q.dtype == torch.float32:
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)
    else:  # low precision: accumulate the scores and the softmax in fp32
        scores = torch.bmm(q, k.transpose(1, 2)).float().mul_(scale).add_(bias)
    return torch.softmax(scores, dim=-1)


def _additive(seen: torch.Tensor) -> torch.Tensor:
    """0 where visible, -inf elsewhere; fp32, since scores are fp32 whatever the model dtype."""
    return torch.zeros(seen.shape, dtype=torch.float32).masked_fill_(~seen, float("-inf"))

"""A native forward for the Llama family (Llama, Mistral, Qwen2): transformers' math in fewer ops.

An unmodified transformers decoder layer runs ~50 tensor ops and a dozen Python modules per layer;
on a small CPU most of a decode step is that overhead (every op dispatches, allocates and opens an
OpenMP region), not arithmetic. `NativeLlama` runs the same model from the same weights with:
- fused Q|K|V and gate|up projections, prepacked once for oneDNN where torch can (fp32; bf16 on
  CPUs with AVX512-BF16), with SiLU, the gate*up product and the residual adds fused into the
  matmuls as oneDNN post-ops;
- RoPE applied to Q and K together from one cos/sin table per step (not per layer);
- K/V written straight into the cell pools and attention read straight from them: for decode-heavy
  steps each query row gathers its own visible cells from the pool (no compacted-window copy
  first), with the mask folded into an additive bias built once per step for all layers.

The transformers modules stay the general path for every other architecture and the oracle the
tests compare this one against (fp32: same logits within 1e-4, same greedy tokens).
"""

import time
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from engine.attention import MaskSpec, gather_rows, row_gather_for
from engine.cells import CellCache, StepPlan

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
    for the dtype it is `F.linear` plus the same epilogue in eager ops (same result).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, gemv: bool = False):
        w = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed = _pack(w)
        # The packed copy replaces the weight, unless one-row calls read it as a GEMV (the LM head:
        # `W @ x` streams W's rows once; on AVX2 fp32 about twice as fast as the GEMM kernels at
        # M=1, on AVX512-BF16 in bf16 about half as fast as the packed kernel: timed once, here).
        self.gemv = gemv and (self.packed is None or _gemv_faster(w, self.packed))
        self.weight = w if self.packed is None or self.gemv else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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


def _cat_linear(*mods) -> Linear:
    biases = [m.bias for m in mods]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else torch.zeros(m.out_features, dtype=m.weight.dtype) for b, m in zip(biases, mods)])
    return Linear(torch.cat([m.weight for m in mods]), bias)


class _Layer:
    """One decoder layer's fused weights and the window its attention uses."""

    def __init__(self, layer, window: int | None):
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1, self.eps1 = layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon
        self.ln2, self.eps2 = layer.post_attention_layernorm.weight.detach(), layer.post_attention_layernorm.variance_epsilon
        self.qkv = _cat_linear(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = Linear(attn.o_proj.weight, attn.o_proj.bias)
        self.gate = Linear(mlp.gate_proj.weight, mlp.gate_proj.bias)
        self.up = Linear(mlp.up_proj.weight, mlp.up_proj.bias)
        self.down = Linear(mlp.down_proj.weight, mlp.down_proj.bias)
        self.scale = attn.scaling
        self.window = window


class _Attend:
    """How this step's queries read the pools, decided once for every layer.

    Steps of one-row (decoding) queries: `gather`, query row i reads only its own visible cells
    (`cells` [T*L] pool indices) with an additive `bias` [Hkv*T, G, L]; or `dense` (one row, or rows
    that each see most of the window), every row reads the step's window (`cells` [C] or the prefix
    [0, read_len)) with `bias` [1, T*G, C]. Steps with a prefill chunk: `split`, each chunk reads only
    the cells its own rows can see, through torch's tiled sdpa kernel with a bool mask, and the
    step's one-row queries are one `gather` part. A chunk reading the whole step window would cost
    its rows x every cell of every sequence in the step (with 32 1,000-token conversations, 32x
    the attention work of reading its own history), and gathering per row would copy its history
    once per row.
    """

    def __init__(self, plan: StepPlan, n_kv: int, group: int, windows, device):
        n_tok = plan.visible.shape[0]
        self.n_tok, self.n_kv, self.group = n_tok, n_kv, group
        ids = plan.seq_ids
        bounds = [0, *((ids[1:] != ids[:-1]).nonzero().flatten() + 1).tolist(), n_tok]
        rows = None
        if len(bounds) - 1 < n_tok:  # some sequence brings several rows: a prefill chunk
            self.mode = "split"
        else:
            rows = row_gather_for(plan, max_tokens=None)
            self.mode = "dense" if rows is None else "gather"
        self.read_len = plan.read_len
        self.bias: dict[int | None, torch.Tensor] = {}
        seen = {w: _windowed(plan, w) for w in windows}  # [T, C] visibility per attention window
        if self.mode == "split":
            self.parts = _split_parts(plan, seen, bounds, n_kv, group, device)
        elif self.mode == "gather":
            self.cells, self.width, self.bias = _gather_part(plan, seen, rows, slice(None), n_kv, group, device)
        else:
            self.cells = None if plan.read_idx is None else plan.read_idx
            for w, mask in seen.items():
                self.bias[w] = _additive(mask).repeat_interleave(group, 0)[None].to(device)

    def read(self, pool: torch.Tensor, cells: torch.Tensor | None) -> torch.Tensor:
        """The K or V rows read, `[Hkv, T*L or C, D]`."""
        if cells is None:
            return pool[0, :, : self.read_len]
        return pool[0].index_select(1, cells)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window) -> torch.Tensor:
        """q `[T, Hq, D]` -> attention output `[T, Hq*D]`."""
        if self.mode != "split":
            width = self.width if self.mode == "gather" else None
            return self._bmm(q, self.read(keys, self.cells), self.read(values, self.cells), self.bias[window],
                             scale, width)
        out = q.new_empty(self.n_tok, q.shape[1] * q.shape[2])
        for part in self.parts:
            k, v = self.read(keys, part.cells), self.read(values, part.cells)
            if part.width is not None:
                out[part.rows] = self._bmm(q[part.rows], k, v, part.masks[window], scale, part.width)
            else:
                o = F.scaled_dot_product_attention(q[part.rows].transpose(0, 1)[None], k[None], v[None],
                                                   attn_mask=part.masks[window], scale=scale,
                                                   enable_gqa=self.group > 1)
                out[part.rows] = o[0].transpose(0, 1).reshape(o.shape[2], -1)
        return out

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


@dataclass
class _Part:
    """Some rows of a `split` step: the pool cells they read and their mask per window (`width` set:
    a gather part with additive biases; None: one chunk's bool mask for sdpa)."""

    rows: slice | torch.Tensor
    cells: torch.Tensor
    masks: dict
    width: int | None = None


def _split_parts(plan: StepPlan, seen: dict, bounds: list[int], n_kv: int, group: int, device) -> list[_Part]:
    """One sdpa part per multi-row chunk (rows `bounds[i]:bounds[i+1]`), one gather part for all one-row ones."""
    parts, singles = [], []
    read_idx = None if plan.read_idx is None else plan.read_idx.cpu()
    for a, b in pairwise(bounds):
        if b - a == 1:
            singles.append(a)
            continue
        cols = plan.visible[a:b].any(0).nonzero().flatten()
        cells = cols if read_idx is None else read_idx[cols]
        masks = {w: mask[a:b, cols][None, None].to(device) for w, mask in seen.items()}
        parts.append(_Part(slice(a, b), cells.to(device), masks))
    if singles:
        rows = torch.tensor(singles)
        cells, width, bias = _gather_part(plan, seen, gather_rows(plan.visible[rows]), rows, n_kv, group, device)
        parts.append(_Part(rows.to(device), cells, bias, width))
    return parts


def _gather_part(plan: StepPlan, seen: dict, gather, rows, n_kv: int, group: int, device):
    """Pool indices `[t*L]`, width L and additive biases `[Hkv*t, G, L]` per window of gathered rows."""
    idx = gather.idx if plan.read_idx is None else plan.read_idx.cpu()[gather.idx]
    n_tok, width = idx.shape
    bias = {}
    for w, mask in seen.items():
        visible = torch.gather(mask[rows], 1, gather.idx) & gather.valid
        bias[w] = _additive(visible)[None, :, None, :].expand(
            n_kv, n_tok, group, width).reshape(n_kv * n_tok, group, width).to(device)
    return idx.reshape(-1).to(device), width, bias


def _softmax_scores(q, k, bias, scale):
    if q.dtype == torch.float32:
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)
    else:  # low precision: accumulate the scores and the softmax in fp32
        scores = torch.bmm(q, k.transpose(1, 2)).float().mul_(scale).add_(bias)
    return torch.softmax(scores, dim=-1)


def _windowed(plan: StepPlan, window: int | None) -> torch.Tensor:
    if window is None:
        return plan.visible
    return plan.visible & (plan.key_pos[None, :] > plan.positions[:, None] - window)


def _additive(seen: torch.Tensor) -> torch.Tensor:
    """0 where visible, -inf elsewhere; fp32, since scores are fp32 whatever the model dtype."""
    return torch.zeros(seen.shape, dtype=torch.float32).masked_fill_(~seen, float("-inf"))


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
        self.head = Linear(model.lm_head.weight, gemv=True)
        self.rotary = base.rotary_emb
        attn = base.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads or self.n_heads
        self.dtype = model.dtype

    def forward(self, cache: CellCache, tokens: torch.Tensor, plan: StepPlan, rows: torch.Tensor) -> torch.Tensor:
        """Logits `[len(rows), vocab]` (fp32) of the given rows of this planned step."""
        n_tok, n_q, n_kv, head_dim = tokens.numel(), self.n_heads, self.n_kv, self.head_dim
        x = F.embedding(tokens, self.embed)  # [T, H]
        cos, sin = self.rotary(x, plan.positions[None])
        half = head_dim // 2
        cos = cos[0, :, None, :]  # [T, 1, D]
        sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)[:, None, :]  # rotate_half's sign folded in
        attend = _Attend(plan, n_kv, n_q // n_kv, self.windows, x.device)
        cells = plan.kv_cells
        for layer, pools in zip(self.layers, cache.layers):
            h = F.rms_norm(x, (x.shape[-1],), layer.ln1, layer.eps1)
            qkv = layer.qkv(h)
            qk = qkv[:, : (n_q + n_kv) * head_dim].view(n_tok, n_q + n_kv, head_dim)
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)  # RoPE on Q and K at once
            q, k = qk[:, :n_q], qk[:, n_q:]
            v = qkv[:, (n_q + n_kv) * head_dim :].view(n_tok, n_kv, head_dim)
            if not pools.is_initialized:
                pools.lazy_initialization(k.transpose(0, 1)[None], v.transpose(0, 1)[None])
            pools.keys.index_copy_(2, cells, k.transpose(0, 1)[None])
            pools.values.index_copy_(2, cells, v.transpose(0, 1)[None])
            a = attend(q, pools.keys, pools.values, layer.scale, layer.window)
            x = layer.o.plus(a, x)
            h = F.rms_norm(x, (x.shape[-1],), layer.ln2, layer.eps2)
            x = layer.down.plus(layer.up.times(h, layer.gate.silu(h)), x)
        x = F.rms_norm(x.index_select(0, rows), (x.shape[-1],), self.norm, self.norm_eps)
        return self.head(x).float()

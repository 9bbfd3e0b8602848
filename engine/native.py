"""A native forward for the Llama family (Llama, Mistral, Qwen2): transformers' math in fewer ops.

An unmodified transformers decoder layer runs ~50 tensor ops and a dozen Python modules per layer;
on a small CPU most of a decode step is that overhead (every op dispatches, allocates and opens an
OpenMP region), not arithmetic. `NativeLlama` runs the same model from the same weights with:
- fused Q|K|V and gate|up projections, prepacked once for oneDNN where torch can (fp32; bf16 on
  CPUs with AVX512-BF16), with SiLU, the gate*up product and the residual adds fused into the
  matmuls as oneDNN post-ops;
- RoPE applied to Q and K together from one cos/sin table per step (not per layer);
- K/V written straight into the cell pools and attention read straight from them
  (`engine/native_attention.py`): decoding rows read their own visible cells, with the mask folded
  into an additive bias built once per step for all layers;
- with the fused CPU kernels (`engine/kernels.py`, built once; eager ops when they cannot be built):
  RMSNorm in one pass, RoPE + the K/V pool write in one pass, and decode attention reading the
  cells in place, so a layer runs 9 ops instead of ~35; and at one row (one sequence decoding)
  every linear streams the model's own weights through `small_linear` (about twice oneDNN's speed
  there), with gate|up and SiLU*up in one call, so a layer runs 8.

The transformers modules stay the general path for every other architecture and the oracle the
tests compare this one against (fp32: same logits within 1e-4, same greedy tokens).
"""

import time

import torch
import torch.nn.functional as F

from engine import kernels
from engine.attention import MaskSpec
from engine.cells import CellCache, StepPlan
from engine.native_attention import Attend

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
    read in place) once at about twice oneDNN's speed at one row (engine/csrc/small_linear.cpp).
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

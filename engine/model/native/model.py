"""A native forward for the Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma 3): transformers' math in fewer ops.

What Qwen3 and Gemma 3 add to the Llama layer (q/k norms, Gemma's norms, GeGLU, scaled embedding, a RoPE table
per layer type, a logit soft-cap) is described in engine/model/native/layer.py; per-head q/k norms run in
place on the fused Q|K|V output (`qk_norm`, one kernel call; eager `F.rms_norm` without the kernels).

An unmodified transformers decoder layer runs ~50 tensor ops and a dozen Python modules per layer;
on a small CPU most of a decode step is that overhead (every op dispatches, allocates and opens an
OpenMP region), not arithmetic. `NativeLlama` runs the same model from the same weights with:
- fused Q|K|V and gate|up projections, prepacked once for oneDNN where torch can (fp32; bf16 on
  CPUs with AVX512-BF16), with SiLU, the gate*up product and the residual adds fused into the
  matmuls as oneDNN post-ops; the packed copy is the only one (engine/model/native/linear.py), a tied
  embedding's rows are read from the LM head's;
- RoPE applied to Q and K together from one cos/sin table per step (not per layer);
- K/V written straight into the cell pools and attention read straight from them
  (`Attend`, below): decoding rows read their own visible cells, with the mask folded into an
  additive bias built once per step for all layers;
- with the fused CPU kernels (`engine/model/kernels/build.py`, built once; eager ops when they cannot be built):
  RMSNorm in one pass, RoPE + the K/V pool write in one pass, and decode attention reading the
  cells in place, so a layer runs 9 ops instead of ~35; and at one row (one sequence decoding)
  every linear streams its packed weight through `packed_linear` (about twice oneDNN's speed
  there), with gate|up and SiLU*up in one call, so a layer runs 8.
- int8 KV cells (`--kv-cache-dtype int8`, engine/cells/int8_kv.py): `rope_store_q8` quantizes each K/V
  head row as it writes it and `cell_attention_q8` reads the int8 rows in place (a row's scale applied
  to its dot product and to its softmax weight); the eager parts dequantize only the rows they read.

The transformers modules stay the general path for every other architecture and the oracle the
tests compare this one against (fp32: same logits within 1e-4, same greedy tokens).

How the queries read the cell pools is decided once a step for every layer (`Attend`).
A step is one or more parts, each a set of query rows and the pool cells they read:
- `cells` (with the fused kernels, `engine/model/kernels/build.py`): each one-row (decoding) query reads its own
  visible cells in place from the pools (`torch.ops.cellserve.cell_attention`, no copy), in blocks of 16 cells;
  a sequence's drafted rows are given its last row's cells, each masked to its own view, so each block is
  converted once for all of them (kernels/csrc/cell_blocks.h), every row still as it would be alone;
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


import torch
import torch.nn.functional as F

from engine.cells.cache import CellCache
from engine.cells.plan import StepPlan
from engine.model.hf_attention import MaskSpec
from engine.model.kernels import build as kernels
from engine.model.native.attention import Attend
from engine.model.native.layer import Family, Layer, norm_eps, norm_weight
from engine.model.native.linear import fused_linear, two_copies
from engine.model.native.moe import gguf_moe, moe_of, moe_unsupported

NATIVE_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


def native_unsupported(model) -> str | None:
    """Why `NativeLlama` cannot run `model` (None when it can): anything it does not reproduce exactly."""
    name = type(model).__name__
    if name not in NATIVE_ARCHS:
        return f"{name} is not one of {NATIVE_ARCHS}"
    cfg = model.config
    family = Family.of(model)
    if family.act not in ("silu", "gelu_tanh"):
        return f"hidden activation {family.act!r}"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return f"attention logit soft-capping ({cfg.attn_logit_softcapping})"
    moe = next(filter(None, (moe_unsupported(layer.mlp) for layer in model.model.layers)), None)
    if moe:
        return moe
    if model.device.type != "cpu":
        return "the native forward is written for CPU"
    return None


class NativeLlama:
    """The Llama-family forward over a `CellCache`, built from (and sharing the math of) an HF model.

    Guarantees: the same logits as the transformers modules over the same cells (fp32 within
    float rounding; the equivalence tests check it against a cacheless forward), using the same
    K/V pools, so the cache verbs, forks and the reference path all see one pool.
    """

    def __init__(self, model, spec: MaskSpec, tensors: dict | None = None):
        """`tensors` (a GGUF file's, engine/loader/gguf_tensors.py): the weights to run instead of the
        model's own, quantized linears kept quantized (engine/model/native/quant.py); `model` is then
        only the architecture (a placeholder skeleton). They are taken out of the dict as each layer is built,
        so what a layer re-lays is freed at once."""
        reason = native_unsupported(model)
        if reason:
            raise ValueError(f"no native forward: {reason}")
        cfg = model.config
        base = model.model
        self.family = family = Family.of(model)
        types = getattr(cfg, "layer_types", None) or [None] * len(base.layers)
        if spec.layer_windows is not None:
            windows = [spec.layer_windows[types[i]] for i in range(len(base.layers))]
        else:
            windows = [spec.window] * len(base.layers)
        if tensors is None:
            self.layers = [Layer(layer, w, family, t, mlp=moe_of(layer.mlp))  # a MoE block: engine/model/native/moe.py
                           for layer, w, t in zip(base.layers, windows, types)]
            self.norm = norm_weight(base.norm, family.norm_plus_one)  # not a view into the file's mapping
            self.head = fused_linear(model.lm_head, gemv=True)
            table = base.embed_tokens.weight
            # a tied table is the head's weight: looked up in the head's packed copy, not kept twice
            tied = table.data_ptr() == model.lm_head.weight.data_ptr() and self.head.panels is not None
            # an untied table: its own copy, so the file's mapping can go (the two-copy A/B keeps the view, as before)
            self.embed = self.head.rows if tied else table.detach() if two_copies() else table.detach().clone()
        else:
            from engine.model.native import quant

            self.layers = [Layer(layer, w, family, t, gguf_moe(quant.layer_weights(tensors, i, family.act), layer.mlp))
                           for i, (layer, w, t) in enumerate(zip(base.layers, windows, types))]
            self.embed, self.norm, self.head = quant.model_weights(tensors)
        self.windows = sorted(set(windows), key=lambda w: -1 if w is None else w)
        if family.embed_scale is None:
            self._embed = self._lookup
        self.norm_eps = norm_eps(base.norm)
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

    def forward(self, cache: CellCache, tokens: torch.Tensor, plan: StepPlan, rows: torch.Tensor,
                lora=None, hidden_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits `[len(rows), vocab]` (fp32) of the given rows of this planned step; `lora`: the step's
        adapters (engine/model/lora.py `StepLora`), each adding its update to its own rows. Second: the final
        hidden states `[len(hidden_rows), hidden]` (the forward's dtype, after the final norm, before the head) of
        `hidden_rows` (embeddings), or None. The norm is per row: a row's hidden state is the same whichever
        other rows are asked for."""
        x = self._embed(tokens)
        attend = Attend(plan, self.n_kv, self.n_heads // self.n_kv, self.windows, x.device, self.fused)
        ropes = self._ropes(x, plan.positions)
        cells = plan.kv_cells
        for pools in cache.layers:
            if not pools.is_initialized:  # the pools take their shape from the first K/V they see
                kv = x.new_zeros(1, self.n_kv, 1, self.head_dim)
                pools.lazy_initialization(kv, kv)
        for i, (layer, pools) in enumerate(zip(self.layers, cache.layers)):
            deltas = None if lora is None else lora.layer(i)
            x = self._layer(layer, x, pools, ropes[layer.layer_type], cells, attend, deltas)
        hidden = None
        if hidden_rows is not None:
            hidden = self._norm(x.index_select(0, hidden_rows), self.norm, self.norm_eps)
        return self.logits(self._norm(x.index_select(0, rows), self.norm, self.norm_eps)), hidden

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head (and the family's soft-cap) over final hidden states `x` (after the final norm): fp32."""
        logits = self.head(x).float()
        cap = self.family.softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token rows `[T, H]` (a quantized table, QuantEmbedding, looks its rows up itself), scaled where the
        family scales them (Gemma: by sqrt(hidden), rounded to the rows' dtype as transformers rounds it)."""
        x = self._lookup(tokens)
        scale = self.family.embed_scale
        return x if scale is None else x * torch.tensor(scale, dtype=x.dtype)

    def _lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token rows, unscaled (`_embed` itself where the family does not scale them)."""
        return F.embedding(tokens, self.embed) if isinstance(self.embed, torch.Tensor) else self.embed(tokens)

    def _ropes(self, x: torch.Tensor, positions: torch.Tensor) -> dict:
        """The step's RoPE tables (cos, sin) by layer type: one for every layer, or one per type where the family's
        layer types have their own bases (Gemma 3's local layers), each computed once a step."""
        kinds = {layer.layer_type for layer in self.layers} if self.family.rope_by_type else {None}
        out = {}
        for kind in kinds:
            cos, sin = self.rotary(x, positions[None], kind) if kind is not None else self.rotary(x, positions[None])
            out[kind] = (cos[0], sin[0]) if self.fused else _eager_rope(cos, sin, self.head_dim)
        if not self.family.rope_by_type:  # every layer reads the one table, whatever its type
            out |= dict.fromkeys({layer.layer_type for layer in self.layers}, out[None])
        return out

    def _layer(self, layer: Layer, x, pools, rope, cells, attend, lora=None) -> torch.Tensor:
        """One decoder layer; `lora` (a `LayerDeltas`): adapters' updates added to each linear's output."""
        h = self._norm(x, layer.ln1, layer.eps1)
        qkv = layer.qkv(h)
        if lora is not None:
            qkv = lora.add("qkv", h, qkv)
        if layer.q_norm is not None:
            self._qk_norm(layer, qkv)
        q = self._rope_store(qkv, rope, pools, cells)
        a = attend(q, pools, layer.scale, layer.window)
        if layer.post_attn is None:
            x = layer.o.plus(a, x)
            if lora is not None:
                x = lora.add("o", a, x)
        else:
            o = layer.o(a)
            if lora is not None:
                o = lora.add("o", a, o)
            x = x + self._norm(o, layer.post_attn, layer.eps1).to(x.dtype)
        h = self._norm(x, layer.ln2, layer.eps2)
        mlp = layer.mlp if lora is None else lora.mlp(layer.mlp)
        if layer.post_ffn is None:
            return mlp(h, x)
        return x + self._norm(mlp(h), layer.post_ffn, layer.eps2).to(x.dtype)

    def _qk_norm(self, layer: Layer, qkv: torch.Tensor) -> None:
        """Qwen3's / Gemma 3's RMSNorm over each Q and K head of `qkv` `[T, (Hq + 2 Hkv) D]`, in place."""
        n_q, n_kv, dim = self.n_heads, self.n_kv, self.head_dim
        if self.fused:
            torch.ops.cellserve.qk_norm(qkv, layer.q_norm, layer.k_norm, n_q, n_kv, layer.qk_eps)
            return
        n_tok = qkv.shape[0]
        for heads, first, weight in ((n_q, 0, layer.q_norm), (n_kv, n_q, layer.k_norm)):
            part = qkv[:, first * dim:(first + heads) * dim].view(n_tok, heads, dim)
            part.copy_(F.rms_norm(part, (dim,), weight, layer.qk_eps))

    def _norm(self, x, weight, eps) -> torch.Tensor:
        if self.fused:
            return torch.ops.cellserve.rms_norm(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def _rope_store(self, qkv, rope, pools, cells) -> torch.Tensor:
        """RoPE on Q and K, K and V written into their cells; returns Q `[T, Hq, D]`."""
        n_q, n_kv = self.n_heads, self.n_kv
        if self.fused and pools.quantized:  # int8 cells: each K/V head row quantized as it is written
            return torch.ops.cellserve.rope_store_q8(qkv, *rope, pools.keys, pools.values, pools.k_scale,
                                                     pools.v_scale, cells, n_q, n_kv)
        if self.fused:
            return torch.ops.cellserve.rope_store(qkv, *rope, pools.keys, pools.values, cells, n_q, n_kv)
        n_tok, head_dim = qkv.shape[0], self.head_dim
        cos, sin = rope
        qk = qkv[:, : (n_q + n_kv) * head_dim].view(n_tok, n_q + n_kv, head_dim)
        qk = torch.addcmul(qk * cos, qk.roll(head_dim // 2, -1), sin)  # RoPE on Q and K at once
        v = qkv[:, (n_q + n_kv) * head_dim :].view(n_tok, n_kv, head_dim)
        pools.store(cells, qk[:, n_q:].transpose(0, 1)[None], v.transpose(0, 1)[None])
        return qk[:, :n_q]


def _eager_rope(cos: torch.Tensor, sin: torch.Tensor, head_dim: int):
    """cos `[T, 1, D]` and sin `[T, 1, D]` with rotate_half's sign folded in (for `roll`)."""
    half = head_dim // 2
    return cos[0, :, None, :], torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)[:, None, :]

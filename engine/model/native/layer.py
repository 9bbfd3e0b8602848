"""One decoder layer of the native forward: its weights in the native layout and the pieces that vary by family.

`Family` says what a model family adds to the Llama layer, read once from the transformers model:
- Qwen3, Gemma 3: `q_norm` / `k_norm`, an RMSNorm over each Q and K head before RoPE;
- Gemma 3: RMSNorm scaled by (1 + w) (the weights are stored here with the 1 added, so every norm runs as
  Llama's), GeGLU (tanh-approximated GELU in place of SiLU), norms after attention and after the MLP as well
  as before ("sandwich" norms), the embedding scaled by sqrt(hidden), a RoPE table per layer type (local
  layers their own base) and an optional final logit soft-cap.
`Layer` holds one layer's weights; its MLP is a pluggable piece (`DenseMLP`, or anything with the same
`__call__(h, residual)` and `linears()`, e.g. a mixture-of-experts block), so the layer never looks inside it.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.native.linear import Linear, cat_bias, fused_linear, small_swiglu

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config's hidden_act -> the MLP's gate


@dataclass(frozen=True)
class Family:
    """What a model family changes in the Llama layer (module docstring); Llama's own is `Family()`."""

    act: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qk_norm: bool = False
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w): Gemma
    sandwich: bool = False  # norms after attention and after the MLP as well
    embed_scale: float | None = None  # the embedding rows multiplied by this (Gemma: sqrt(hidden))
    rope_by_type: bool = False  # one RoPE table per layer type (the rotary module takes `layer_type`)
    softcap: float | None = None  # final logits: cap * tanh(logits / cap)

    @staticmethod
    def of(model) -> "Family":
        cfg = model.config
        layer = model.model.layers[0]
        gemma = hasattr(layer, "pre_feedforward_layernorm")
        act = getattr(cfg, "hidden_activation", None) if gemma else getattr(cfg, "hidden_act", "silu")
        return Family(act=ACTIVATIONS.get(act, act), qk_norm=hasattr(layer.self_attn, "q_norm"),
                      norm_plus_one=gemma, sandwich=gemma,
                      embed_scale=float(cfg.hidden_size) ** 0.5 if gemma else None, rope_by_type=gemma,
                      softcap=getattr(cfg, "final_logit_softcapping", None) if gemma else None)


def norm_weight(module, plus_one: bool) -> torch.Tensor:
    """The weight of a transformers RMSNorm: an own copy (a view would keep the whole safetensors mapping the
    parameters came from alive), with Gemma's 1 added."""
    w = module.weight.detach().clone()
    return w + 1 if plus_one else w


def norm_eps(module) -> float:
    """The epsilon of a transformers RMSNorm (`variance_epsilon` in the Llama family, `eps` in Gemma's)."""
    eps = getattr(module, "variance_epsilon", None)
    return float(module.eps if eps is None else eps)


class DenseMLP:
    """`down(act(gate(h)) * up(h))`, the residual add fused into `down` when given. `gate_up` set: a quantized
    [gate; up] linear with its own `swiglu` (engine/model/native/quant.py)."""

    def __init__(self, gate, up, down, gate_up_bias=None, act: str = "silu", gate_up=None):
        self.gate, self.up, self.down, self.gate_up_bias, self.act, self.gate_up = gate, up, down, gate_up_bias, act, gate_up
        # the product's code chosen once here, not tested per call (a decode step calls it once a layer)
        if act != "silu":
            self.glu = self._geglu
        elif gate_up is not None:
            self.glu = gate_up.swiglu
        else:
            self.glu = self._swiglu

    @staticmethod
    def of(mlp, act: str) -> "DenseMLP":
        return DenseMLP(fused_linear(mlp.gate_proj), fused_linear(mlp.up_proj), fused_linear(mlp.down_proj),
                        cat_bias(mlp.gate_proj, mlp.up_proj), act)

    def linears(self) -> list:
        return [self.gate, self.up, self.down]

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        g = self.glu(h)
        return self.down(g) if residual is None else self.down.plus(g, residual)

    def glu(self, h: torch.Tensor) -> torch.Tensor:
        """`act(gate(h)) * up(h)` (replaced per instance by the code for its activation and layout)."""
        raise NotImplementedError  # pragma: no cover - __init__ binds one of the methods below

    def _swiglu(self, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU in one small-row kernel call at one row, else two fused oneDNN calls."""
        if self.gate.is_small(h):
            return small_swiglu(self.gate, self.up, h, self.gate_up_bias)
        return self.up.times(h, self.gate.silu(h))

    def _geglu(self, h: torch.Tensor) -> torch.Tensor:
        """GeGLU from the gate and up outputs (one [gate; up] call where quantized)."""
        if self.gate_up is not None:
            y = self.gate_up(h)
            n = y.shape[1] // 2
            return F.gelu(y[:, :n], approximate="tanh").mul_(y[:, n:])
        return F.gelu(self.gate(h), approximate="tanh").mul_(self.up(h))


class Layer:
    """One decoder layer's fused weights, the window its attention uses and its layer type (the RoPE table)."""

    def __init__(self, layer, window: int | None, family: Family, layer_type: str | None = None,
                 quantized: dict | None = None, mlp=None):
        """`mlp`: the layer's MLP piece when it is not a `DenseMLP` of `layer.mlp` (a mixture-of-experts block)."""
        attn = layer.self_attn
        self.scale = attn.scaling
        self.window = window
        self.layer_type = layer_type
        self.q_norm = self.k_norm = self.post_attn = self.post_ffn = None
        second = layer.pre_feedforward_layernorm if family.sandwich else layer.post_attention_layernorm
        self.eps1, self.eps2 = norm_eps(layer.input_layernorm), norm_eps(second)
        self.qk_eps = norm_eps(attn.q_norm) if family.qk_norm else 0.0
        if quantized is not None:  # the weights come from a GGUF file as they are (quant.layer_weights)
            for name, value in quantized.items():
                setattr(self, name, value)
            return
        one = family.norm_plus_one
        self.ln1, self.ln2 = norm_weight(layer.input_layernorm, one), norm_weight(second, one)
        if family.sandwich:
            self.post_attn = norm_weight(layer.post_attention_layernorm, one)
            self.post_ffn = norm_weight(layer.post_feedforward_layernorm, one)
        if family.qk_norm:
            self.q_norm, self.k_norm = norm_weight(attn.q_norm, one), norm_weight(attn.k_norm, one)
        self.qkv = fused_linear(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = fused_linear(attn.o_proj)
        self.mlp = mlp if mlp is not None else DenseMLP.of(layer.mlp, family.act)

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o, *self.mlp.linears()]

    def norms(self) -> list[torch.Tensor]:
        """Every norm weight this layer holds (for byte counts)."""
        return [t for t in (self.ln1, self.ln2, self.q_norm, self.k_norm, self.post_attn, self.post_ffn)
                if t is not None]

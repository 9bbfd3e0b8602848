"""LoRA adapters from the files people have: a PEFT folder (here) and llama.cpp's LoRA GGUF
(engine/loader/adapter_gguf.py), both read into `AdapterWeights`; `read_adapter` (in adapter_gguf.py)
picks the reader by the path.

A PEFT folder (`read_peft_folder`) holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors` (`...layers.{i}.self_attn.q_proj.lora_A.weight` `[r, in]` and `lora_B.weight`
`[out, r]` per targeted linear). `read_peft_folder` returns them as `AdapterWeights`: per layer, per
projection, (A, B, scale) with PEFT's scale, `lora_alpha / r` (or `lora_alpha / sqrt(r)` with `use_rslora`).
The arithmetic that applies them lives in engine/model/lora.py. What this reader refuses, it refuses with the
reason: DoRA, biases, embedding/LM-head targets, `modules_to_save`, rank/alpha patterns, anything that is not
a plain low-rank update of a decoder layer's linears (what the native forward can apply without merging).
The file layout is read with `safetensors` and `json`; PEFT itself is a test-only dependency (the oracle).
"""

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

# the decoder layer's linears an adapter may target (PEFT's module names; the native forward fuses q|k|v, gate|up)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# a mixture-of-experts block's expert MLPs or router (Mixtral's block_sparse_moe, Qwen-MoE's mlp.experts / mlp.gate)
_MOE_KEY = re.compile(r"(layers\.\d+\.(?:mlp|block_sparse_moe)\.(?:experts\.\d+\.\w+|shared_experts?\.\w+|experts|gate"
                      r"|router))\.lora_[AB]")
_REFUSED_CONFIG = {
    "use_dora": "DoRA (use_dora) adapters",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
}


class AdapterError(ValueError):
    """An adapter folder or file cannot be served; the message says what is wrong and what to do."""


@dataclass
class AdapterWeights:
    """One adapter as read: `layers[i][projection] = (A [r, in], B [out, r], scale)` (float32), the update of
    that linear being `scale * (x @ A.T) @ B.T`. `nbytes`: A's and B's bytes as read."""

    path: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for mods in self.layers.values() for a, b, _ in mods.values())


def read_peft_folder(path: str | Path) -> AdapterWeights:
    folder = Path(path).expanduser()
    cfg_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"{folder} is not a PEFT LoRA folder: it needs adapter_config.json and "
                           f"adapter_model.safetensors (save one with peft's model.save_pretrained), or give "
                           f"a llama.cpp LoRA .gguf file")
    cfg = json.loads(cfg_file.read_text())
    _check_config(cfg, folder)
    r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha") or cfg["r"])
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        moe = _MOE_KEY.search(key)
        if moe is not None:
            raise AdapterError(moe_refusal(str(weights_file), moe.group(1)))
        m = _KEY.search(key)
        if m is None or m.group(2) not in PROJECTIONS:
            raise AdapterError(f"{weights_file}: tensor {key!r} is not a LoRA A/B of a decoder layer's "
                               f"{'/'.join(PROJECTIONS)}; only those are served")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor.float()
    out = AdapterWeights(str(folder), r, alpha, tuple(sorted({proj for _, proj in pairs})))
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights_file}: layer {layer} {proj} has lora_{next(iter(ab))} but not its pair")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != b.shape[1]:
            raise AdapterError(f"{weights_file}: layer {layer} {proj}: A {tuple(a.shape)} and B {tuple(b.shape)} "
                               f"disagree on the rank")
        out.layers.setdefault(layer, {})[proj] = (a, b, scale)
    if not out.layers:
        raise AdapterError(f"{weights_file} holds no LoRA weights")
    return out


def moe_refusal(where: str, module: str) -> str:
    """Why an adapter targeting `module` (a mixture-of-experts expert MLP or router) is refused."""
    return (f"{where}: the adapter targets {module}, a mixture-of-experts expert MLP or router; LoRA updates are "
            f"served on the attention projections and dense MLPs only (the experts run fused, without a per-row "
            f"update): use an adapter of q/k/v/o_proj, or merge this one into the model")


def _check_config(cfg: dict, folder: Path) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are served")
    for key, what in _REFUSED_CONFIG.items():
        if cfg.get(key):
            raise AdapterError(f"{folder}: {what} are not served; train a plain LoRA or merge it into the model")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: bias={cfg['bias']!r} adapters train biases, which are not served; "
                           f"use bias='none' or merge the adapter into the model")
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise AdapterError(f"{folder}: adapter_config.json needs an integer r >= 1, got {cfg.get('r')!r}")

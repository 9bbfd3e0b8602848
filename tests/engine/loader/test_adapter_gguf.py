"""llama.cpp's LoRA GGUF (engine/loader/adapter_gguf.py): the file convert_lora_to_gguf.py makes from a PEFT
folder gives the PEFT model's logits (float32 atol 1e-4; f16 tensors within f16's rounding, atol 2e-3).

`write_lora_gguf` writes what the converter writes (checked byte-layout for byte-layout against the converter's
own output of a tiny Llama adapter when written: tensor names, [r, in] / [out, r] order, `adapter.lora.alpha`,
Q's and K's B rows permuted for a llama file), with gguf-py, so the suite needs no llama.cpp checkout.
"""

import json

import gguf
import numpy as np
import pytest
import torch
from lora_support import ALL, ATTN, peft_adapter
from safetensors.torch import load_file
from tiny_gguf import _permute
from tiny_models import full_logits, tiny_model

from engine.api.lora import LoraBinding
from engine.loader.adapters import AdapterError
from engine.model.flat_step import flatten_step
from engine.model.lora import step_rows
from engine.model.runner import ModelRunner

GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def write_lora_gguf(peft_dir, path, arch: str, n_head: int, n_kv: int, dtype=np.float32) -> str:
    """What convert_lora_to_gguf.py writes for the PEFT folder `peft_dir` (see the module docstring)."""
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(cfg["lora_alpha"]))
    for key, t in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        layer, proj, ab = key.split("layers.")[1].split(".")[0], key.split(".")[-3], key.split(".")[-2]
        w = t.float().numpy()
        if arch == "llama" and ab == "lora_B" and proj in ("q_proj", "k_proj"):
            w = _permute(w, n_head if proj == "q_proj" else n_kv)
        writer.add_tensor(f"blk.{layer}.{GGUF_NAMES[proj]}.weight.lora_{ab[-1].lower()}", w.astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("name,arch,targets,dtype,atol", [
    ("llama_gqa", "llama", ALL, np.float32, 1e-4),
    ("qwen2", "qwen2", ATTN, np.float32, 1e-4),
    ("llama_gqa", "llama", ALL, np.float16, 2e-3),
])
def test_the_gguf_adapter_gives_the_peft_models_logits(name, arch, targets, dtype, atol, tmp_path):
    base = tiny_model(name)
    folder, merged = peft_adapter(base, tmp_path / "peft", r=8, alpha=12, targets=targets)
    cfg = base.config
    path = write_lora_gguf(tmp_path / "peft", tmp_path / "a.gguf", arch, cfg.num_attention_heads,
                           cfg.num_key_value_heads, dtype)
    runner = ModelRunner(tiny_model(name), n_cells=128)
    g, _ = runner.loras.load("g", path)
    p, _ = runner.loras.load("p", folder)
    assert g.info.rank == 8 and g.info.alpha == 12 and g.info.targets == p.info.targets
    ids = list(range(3, 24))
    step = flatten_step({0: (ids, 0), 1: (ids, 0)})
    step.lora = step_rows([LoraBinding(g.uid, "g"), LoraBinding(p.uid, "p")], [len(ids), len(ids)])
    out = runner.forward(step)
    torch.testing.assert_close(out[0], full_logits(merged, ids)[-1], atol=atol, rtol=0)
    torch.testing.assert_close(out[1], full_logits(merged, ids)[-1], atol=1e-4, rtol=0)


def _write(path, tensors: dict, adapter: bool) -> str:
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    if adapter:
        writer.add_string("general.type", "adapter")
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", 8.0)
    for name, t in tensors.items():
        writer.add_tensor(name, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_gguf_that_is_not_a_lora_adapter_is_refused(tmp_path):
    runner = ModelRunner(tiny_model("llama_gqa"), n_cells=16)
    path = _write(tmp_path / "m.gguf", {"token_embd.weight": np.zeros((4, 8), dtype=np.float32)}, adapter=False)
    with pytest.raises(AdapterError, match="not a llama.cpp LoRA adapter"):
        runner.loras.load("m", path)
    experts = {f"blk.0.ffn_gate_exps.weight.lora_{ab}": np.zeros((4, 8), dtype=np.float32) for ab in "ab"}
    with pytest.raises(AdapterError, match="targets blk.0.ffn_gate_exps.weight, a mixture-of-experts expert MLP"):
        runner.loras.load("e", _write(tmp_path / "e.gguf", experts, adapter=True))
    assert not runner.loras.adapters

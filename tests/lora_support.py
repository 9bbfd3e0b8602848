"""Random PEFT LoRA adapters on tiny models, and their oracle: the PEFT model merged (float32).

PEFT is a test-only dependency (the dev extra): the engine reads the folders it writes itself
(engine/loader/adapters.py), and the merged PEFT model is what its logits are compared with.
"""

import copy

import torch
from peft import LoraConfig, get_peft_model

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTN + ["gate_proj", "up_proj", "down_proj"]


def peft_adapter(base, folder, *, r: int = 8, alpha: int = 16, targets=ALL, seed: int = 1, rslora: bool = False,
                 magnitude: float = 0.3):
    """A random LoRA of `base` saved as a PEFT folder at `folder`; returns (folder, the merged model).
    A and B are both random (PEFT's init zeroes B), scaled by `magnitude` so the update moves the logits
    by about as much as the base weights do."""
    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                  use_rslora=rslora, init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * magnitude / p.shape[-1] ** 0.5)
    peft_model.save_pretrained(str(folder))
    merged = peft_model.merge_and_unload().eval()
    return str(folder), merged

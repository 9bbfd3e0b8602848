"""A local Hugging Face causal-LM folder -> the transformers model and its tokenizer; never downloads."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.api.cpu import auto_float_dtype


def load_hf_folder(path: str | Path, *, dtype: torch.dtype | str = "auto", attn_implementation: str = "sdpa",
                   device: str = "cpu"):
    """(model, tokenizer) of the folder at `path` (config, safetensors, tokenizer).

    `dtype="auto"` is this CPU's float dtype on the CPU (`engine.api.cpu.auto_float_dtype`: bfloat16 where the CPU
    multiplies bf16 natively, else float32), whatever the checkpoint was saved in; a name like "bfloat16"
    or a torch dtype forces one. Raises FileNotFoundError when `path` has no config.json.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model folder: it has no config.json")
    if dtype == "auto" and device == "cpu":
        dtype = auto_float_dtype()
    if isinstance(dtype, str) and dtype != "auto":  # "auto" off the CPU: as saved
        dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    ).to(device)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer

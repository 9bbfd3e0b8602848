"""A local Hugging Face causal-LM folder -> the transformers model and its tokenizer; never downloads."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def load_hf_folder(path: str | Path, *, dtype: torch.dtype | str = "auto", attn_implementation: str = "sdpa",
                   device: str = "cpu"):
    """(model, tokenizer) of the folder at `path` (config, safetensors, tokenizer).

    `dtype="auto"` keeps the checkpoint's dtype (as vLLM's default); a name like "bfloat16" or a
    torch dtype forces one. Raises FileNotFoundError when `path` has no config.json.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model folder: it has no config.json")
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    ).to(device)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer

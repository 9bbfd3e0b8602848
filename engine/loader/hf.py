"""A local Hugging Face causal-LM folder -> the transformers model and its tokenizer; never downloads."""

import json
import logging
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.api.cpu import auto_float_dtype
from engine.api.errors import ModelSourceError

log = logging.getLogger("cellserve.hf")


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
    try:
        model = _from_pretrained(path, dtype, attn_implementation).to(device)
    except (ValueError, KeyError) as exc:  # transformers' "Unrecognized configuration class/model type ..."
        raise ModelSourceError(f"{path.name}: architecture {_architecture(path)} has no native forward in cellserve "
                               f"and transformers {transformers.__version__} cannot load it as a causal LM "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from exc
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def _from_pretrained(path: Path, dtype, attn_implementation: str):
    """The model, in eager attention where the architecture has no sdpa (Gemma 2's soft-capped scores): the
    cell pools take both (engine/model/hf_attention.py)."""
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                    local_files_only=True)
    except ValueError as exc:
        if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(exc):
            raise
    log.info("%s: no sdpa attention for this architecture; loading it with eager attention", path.name)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager", local_files_only=True)


def _architecture(path: Path) -> str:
    """The folder's architecture as its config.json names it (`architectures`, else `model_type`)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "(unreadable config.json)"
    return repr((cfg.get("architectures") or [None])[0] or cfg.get("model_type"))

"""llama.cpp's LoRA GGUF (`convert_lora_to_gguf.py`, `general.type` "adapter", `adapter.type` "lora") as
`AdapterWeights` (engine/loader/adapters.py), so one adapter gives the same update from either file.

The file holds `blk.{i}.{attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down}.weight.lora_a` `[r, in]` and
`.lora_b` `[out, r]` (numpy's order; f32, f16, bf16 or q8_0, dequantized to float32 here) and
`adapter.lora.alpha`; the scale is llama.cpp's, `alpha / r` (1 when alpha is 0). For a `llama` file the
converter permuted the rows of Q's and K's B as it permutes the base weights for its RoPE; they are put back in
transformers' order with the base model's head counts (as engine/loader/gguf_tensors.py does the base's).
Read with gguf-py's `GGUFReader` (adapter files are small).
"""

from pathlib import Path

import numpy as np
import torch

from engine.loader.adapters import AdapterError, AdapterWeights, moe_refusal, read_peft_folder

NAMES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
         "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


def read_adapter(path: str | Path, heads: tuple[int, int] | None = None) -> AdapterWeights:
    """An adapter from a PEFT folder or a llama.cpp LoRA `.gguf` file; AdapterError naming what is missing.
    `heads`: the base model's (query, kv) head counts (a llama GGUF adapter's Q/K rows are put back with them)."""
    p = Path(path).expanduser()
    return read_gguf_adapter(p, heads) if p.is_file() and p.suffix == ".gguf" else read_peft_folder(p)


def read_gguf_adapter(path: Path, heads: tuple[int, int] | None = None) -> AdapterWeights:
    """`heads`: the base model's (query heads, kv heads), to put a llama file's Q/K rows back in order."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(str(path))
    meta = {k: _value(f) for k, f in reader.fields.items() if k.startswith(("general.", "adapter."))}
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterError(f"{path} is not a llama.cpp LoRA adapter (general.type {meta.get('general.type')!r}, "
                           f"adapter.type {meta.get('adapter.type')!r}); make one with convert_lora_to_gguf.py")
    arch, alpha = meta.get("general.architecture"), float(meta.get("adapter.lora.alpha") or 0.0)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        parts = t.name.split(".")  # blk.{i}.{name}.weight.lora_{a,b}
        if len(parts) == 5 and parts[2].startswith("ffn_") and parts[2].endswith(("_exps", "_inp", "_shexp")):
            raise AdapterError(moe_refusal(str(path), t.name.removesuffix("." + parts[4])))
        if len(parts) != 5 or parts[0] != "blk" or parts[2] not in NAMES or parts[4] not in ("lora_a", "lora_b"):
            raise AdapterError(f"{path}: tensor {t.name!r} is not a LoRA A/B of a decoder layer's "
                               f"{'/'.join(NAMES)}; only those are served")
        data = quants.dequantize(t.data, t.tensor_type) if t.tensor_type != gguf.GGMLQuantizationType.F32 else t.data
        w = torch.from_numpy(np.array(data, dtype=np.float32).reshape(t.data.shape[0], -1))
        pairs.setdefault((int(parts[1]), NAMES[parts[2]]), {})[parts[4][-1].upper()] = w
    if not pairs:
        raise AdapterError(f"{path} holds no LoRA weights")
    ranks = {ab["A"].shape[0] for ab in pairs.values() if "A" in ab}
    out = AdapterWeights(str(path), max(ranks), alpha, tuple(sorted({proj for _, proj in pairs})))
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: layer {layer} {proj} has lora_{next(iter(ab)).lower()} but not its pair")
        a, b = ab["A"], ab["B"]
        if arch == "llama" and proj in ("q_proj", "k_proj"):
            if heads is None:
                raise AdapterError(f"{path}: a llama adapter's Q/K rows need the base model's head counts")
            b = b.index_select(0, _unpermute_index(b.shape[0], heads[0] if proj == "q_proj" else heads[1]))
        out.layers.setdefault(layer, {})[proj] = (a, b, alpha / a.shape[0] if alpha else 1.0)
    return out


def _unpermute_index(n_rows: int, n_head: int) -> torch.Tensor:
    """engine/loader/gguf_tensors.py's row order undoing llama.cpp's Q/K permutation."""
    from engine.loader.gguf_tensors import _unpermute_index as unpermute

    return unpermute(n_rows, n_head)


def _value(field):
    """A GGUF metadata field's value: a string, a number, or None."""
    import gguf

    if not field.types:
        return None
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return None
    return field.parts[field.data[0]].tolist()[0]

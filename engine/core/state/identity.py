"""The identity saved cells are valid for: which weights computed them, in which dtype and KV layout.

K/V computed by one model mean nothing to another (or to the same model in another dtype, or stored in
another KV dtype: `--kv-cache-dtype int8` rows are int8 packed with their scales), so every cell file and
archive carries `ModelIdentity` in its header and a reader refuses any that differs. The weights'
fingerprint hashes the config and, for every tensor of the state dict, its name, shape, dtype and an evenly
strided sample of its values (at most `SAMPLE` elements; engine/model/module_weights.py takes them before
the modules' weights are released): milliseconds even for a large model, and any retrained or differently
quantized checkpoint differs in its samples.
"""

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelIdentity:
    weights: str  # hex fingerprint of config + weights
    dtype: str  # the K/V pools' dtype, e.g. "torch.float32"; int8 cells: "torch.float32/kv-int8" (model dtype/KV)
    layout: str  # "<layers>x<kv heads>x<head dim k>/<head dim v>"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelIdentity":
        doc = json.loads(text)
        return cls(str(doc["weights"]), str(doc["dtype"]), str(doc["layout"]))

    def differs(self, other: "ModelIdentity") -> str | None:
        """None when the same; else which part differs, said for a log line or an error."""
        for name in ("weights", "dtype", "layout"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} {getattr(other, name)} (file) vs {getattr(self, name)} (this engine)"
        return None


def identity_of(runner) -> ModelIdentity:
    """The identity of `runner`'s model and cell pools (a `ModelRunner`)."""
    h = hashlib.sha256(runner.config.to_json_string(use_diff=False).encode())
    for header, sample in runner.weight_samples():  # taken before the modules' weights were released
        h.update(header)
        h.update(sample)
    cfg = runner.config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layout = f"{cfg.num_hidden_layers}x{kv_heads}x{head_dim}/{head_dim}"
    kv = runner.kv_cache_dtype  # int8 cells are another KV dtype: their chunks are not float's
    dtype = str(runner.dtype) if kv == "auto" else f"{runner.dtype}/kv-{kv}"
    return ModelIdentity(h.hexdigest()[:32], dtype, layout)

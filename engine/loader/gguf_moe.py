"""Hugging Face configs of mixture-of-experts GGUF files, built from the file's own metadata.

transformers' GGUF config mapping gets these wrong: for `qwen3moe` it maps no `expert_feed_forward_length`, so
`moe_intermediate_size` stays at its default and the weights do not fit; for a `llama` file with experts
(Mixtral, as llama.cpp writes it) it builds a dense Llama. `moe_config(path, meta, index)` builds the config
from the header (as `read_tensor_index` gives it) itself, and is honest about what it reads: every key under the
architecture's prefix must be one it maps or checks, and a value it cannot reproduce (rope scaling, a
gating function other than softmax, scaled or shared experts, a partial rotary dimension) is a clear error
naming the key, never a silent guess. Hand-written because no library maps these keys correctly.
"""

from pathlib import Path

from engine.api.errors import ModelSourceError

# llama.cpp key (after "ARCH.") -> config field, shared by every MoE architecture here
_MAPPED = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
}
# keys read but not mapped one to one: checked against what the forward computes (`_check`)
_CHECKED = {"feed_forward_length", "expert_feed_forward_length", "attention.key_length", "attention.value_length",
            "rope.dimension_count", "vocab_size", "rope.scaling.type", "expert_gating_func", "expert_weights_norm",
            "expert_weights_scale"}
_GATING_SOFTMAX = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def is_moe_file(meta: dict) -> bool:
    """Whether a GGUF header describes a mixture-of-experts model this module builds the config of."""
    arch = meta.get("general.architecture")
    return arch == "qwen3moe" or (arch == "llama" and int(meta.get("llama.expert_count", 0)) > 0)


def moe_config(path: str | Path, meta: dict, index: dict):
    """The transformers config (Qwen3MoeConfig, or MixtralConfig for a `llama` file with experts) of the
    mixture-of-experts GGUF file `path` from its header (`meta`, `index`: `gguf.read_tensor_index`);
    ModelSourceError for metadata it does not understand."""
    path = Path(path)
    arch = meta["general.architecture"]
    if not is_moe_file(meta):
        raise ModelSourceError(f"{path.name}: {arch!r} is not a mixture-of-experts architecture read here")
    prefix = f"{arch}."
    keys = {k.removeprefix(prefix): v for k, v in meta.items() if k.startswith(prefix)}
    unknown = sorted(set(keys) - set(_MAPPED) - _CHECKED)
    if unknown:
        raise ModelSourceError(f"{path.name}: GGUF metadata this loader does not understand: "
                               f"{', '.join(prefix + k for k in unknown)}; it will not guess what they change")
    missing = sorted(k for k in ("embedding_length", "block_count", "attention.head_count", "expert_count",
                                 "expert_used_count") if k not in keys)
    if missing:
        raise ModelSourceError(f"{path.name}: GGUF metadata lacks {', '.join(prefix + k for k in missing)}")
    fields = {field: keys[k] for k, field in _MAPPED.items() if k in keys}
    fields["rope_theta"] = float(fields.get("rope_theta", 10000.0))
    fields.update(_check(path.name, prefix, keys, fields, index))
    for key, field in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id"),
                       ("tokenizer.ggml.padding_token_id", "pad_token_id")):
        if key in meta:
            fields[field] = int(meta[key])
    fields["tie_word_embeddings"] = "output.weight" not in index
    if arch == "llama":
        from transformers import MixtralConfig

        fields["num_local_experts"] = fields.pop("num_experts")
        fields["intermediate_size"] = fields.pop("moe_intermediate_size")
        fields.pop("head_dim", None)
        if not fields.pop("norm_topk_prob", True):
            raise ModelSourceError(f"{path.name}: llama.expert_weights_norm = false: a Mixtral-layout file whose "
                                   f"router does not renormalise its top k is not supported")
        return MixtralConfig(**fields)
    from transformers import Qwen3MoeConfig

    norm = fields.pop("norm_topk_prob", True)  # llama.cpp's qwen3moe graph renormalises the top k
    return Qwen3MoeConfig(**fields, norm_topk_prob=norm, decoder_sparse_step=1, mlp_only_layers=[])


def _check(name: str, prefix: str, keys: dict, fields: dict, index: dict) -> dict:
    """The fields the checked keys give, each checked against what the native forward computes."""
    def fail(key: str, why: str):
        raise ModelSourceError(f"{name}: {prefix}{key} = {keys[key]!r}: {why}; this file cannot be served as it asks")

    out: dict = {}
    hidden, heads = int(fields["hidden_size"]), int(fields["num_attention_heads"])
    head_dim = int(keys.get("attention.key_length", hidden // heads))
    if int(keys.get("attention.value_length", head_dim)) != head_dim:
        fail("attention.value_length", "values and keys of different widths are not supported")
    if int(keys.get("rope.dimension_count", head_dim)) != head_dim:
        fail("rope.dimension_count", f"rotary embedding over part of a {head_dim}-wide head is not supported")
    out["head_dim"] = head_dim
    if str(keys.get("rope.scaling.type", "none")) != "none":
        fail("rope.scaling.type", "rope scaling is not implemented for this architecture")
    if int(keys.get("expert_gating_func", _GATING_SOFTMAX)) != _GATING_SOFTMAX:
        fail("expert_gating_func", "only softmax routing is implemented")
    if float(keys.get("expert_weights_scale", 1.0)) != 1.0:
        fail("expert_weights_scale", "scaled expert weights are not implemented")
    if "expert_weights_norm" in keys:
        out["norm_topk_prob"] = bool(keys["expert_weights_norm"])
    gate = index.get("blk.0.ffn_gate_exps.weight")
    if gate is None or len(gate.shape) != 3:
        raise ModelSourceError(f"{name}: {prefix}expert_count is set but blk.0.ffn_gate_exps.weight is not a 3-D "
                               f"tensor of experts")
    ff = int(keys.get("expert_feed_forward_length", keys.get("feed_forward_length", gate.shape[1])))
    if ff != gate.shape[1] or int(fields["num_experts"]) != gate.shape[0]:
        fail("expert_feed_forward_length" if "expert_feed_forward_length" in keys else "expert_count",
             f"the expert tensors are {list(gate.shape)} (experts, width, hidden)")
    out["moe_intermediate_size"] = ff
    out["intermediate_size"] = int(keys.get("feed_forward_length", ff))
    vocab = index["token_embd.weight"].shape[0]
    if int(keys.get("vocab_size", vocab)) != vocab:
        fail("vocab_size", f"the embedding has {vocab} rows")
    out["vocab_size"] = vocab
    return out

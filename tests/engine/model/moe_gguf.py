"""Tiny mixture-of-experts GGUF files written as llama.cpp's converter writes them, and their oracle.

`write_moe_gguf(path, model, qtype)` writes a Qwen3-MoE model as a `qwen3moe` file, or a Mixtral as a `llama`
file with experts (Q/K rows permuted for llama.cpp's RoPE), each expert projection one 3-D tensor
`blk.N.ffn_{gate,up,down}_exps` [E, N, K] quantized row by row, the router `ffn_gate_inp` in F32 (as
llama-quantize keeps it). It returns the oracle: a copy of `model` whose every weight is what the file
holds, dequantized by gguf-py (quantize then dequantize, row by row: a row permutation commutes with it).
The tokenizer is the bundled model's (tests/engine/loader/tiny_gguf.py), so the vocabulary is 4096.
"""

import copy
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import quants

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "loader"))  # the GGUF tests' helpers
from kquants import quantize as quantize_k
from tiny_gguf import add_default_tokenizer

Q = gguf.GGMLQuantizationType
K_TYPES = {Q.Q4_K, Q.Q5_K, Q.Q6_K}
VOCAB = 4096


def q4_k_m(name: str):
    """llama.cpp's Q4_K_M choice for these files: Q6_K for the head, attn_v and the experts' down projection
    (its "more bits" layers), Q4_K for the rest."""
    return Q.Q6_K if name == "output.weight" or ".attn_v." in name or "ffn_down" in name else Q.Q4_K


def _quantize(a: np.ndarray, q) -> tuple[np.ndarray, np.ndarray]:
    """(the file's bytes, what they dequantize to) of float32 `a` (rows along the last axis)."""
    if q in K_TYPES:
        raw = quantize_k(a.reshape(-1, a.shape[-1]), q).reshape(*a.shape[:-1], -1)
    else:
        raw = quants.quantize(a, q)
    return raw, quants.dequantize(raw, q).reshape(a.shape).astype(np.float32)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _header(w, cfg, arch: str) -> None:
    w.add_name(f"tiny {arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3moe":
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    add_default_tokenizer(w)


def write_moe_gguf(path, model, qtype, extra: dict | None = None):
    """`model` (Qwen3MoeForCausalLM or MixtralForCausalLM, float32) as a GGUF file at `path` with its matrices
    in `qtype` (or `qtype(name)`); `extra`: more metadata key/values (to test what the loader refuses).
    Returns the oracle model (module docstring)."""
    cfg = model.config
    arch = "qwen3moe" if type(model).__name__.startswith("Qwen3Moe") else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    _header(w, cfg, arch)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value) if isinstance(value, int) else w.add_string(key, value)
    oracle = copy.deepcopy(model)
    state = oracle.state_dict()

    def put(name: str, hf: str, q=None, index=None, heads=None):
        t = state[hf] if index is None else state[hf][index]
        a = t.detach().float().numpy()
        q = q(name) if callable(q) and not isinstance(q, Q) else q
        if q is None or a.ndim == 1:
            w.add_tensor(name, a)
            return
        raw, back = _quantize(a, q)
        with torch.no_grad():
            t.copy_(torch.from_numpy(back))  # the oracle holds what the file holds
        if heads is not None:
            raw = _permute(raw, heads)
        w.add_tensor(name, raw, raw_dtype=q)

    put("token_embd.weight", "model.embed_tokens.weight", qtype)
    put("output.weight", "lm_head.weight", qtype)
    put("output_norm.weight", "model.norm.weight")
    llama = arch == "llama"
    inter = cfg.intermediate_size if llama else cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", p + "input_layernorm.weight")
        put(b + "ffn_norm.weight", p + "post_attention_layernorm.weight")
        put(b + "attn_q.weight", p + "self_attn.q_proj.weight", qtype, heads=cfg.num_attention_heads if llama else None)
        put(b + "attn_k.weight", p + "self_attn.k_proj.weight", qtype, heads=cfg.num_key_value_heads if llama else None)
        put(b + "attn_v.weight", p + "self_attn.v_proj.weight", qtype)
        put(b + "attn_output.weight", p + "self_attn.o_proj.weight", qtype)
        if not llama:
            put(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight")
            put(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight")
        put(b + "ffn_gate_inp.weight", p + "mlp.gate.weight")  # F32, as llama-quantize leaves it
        gate_up = p + "mlp.experts.gate_up_proj"
        put(b + "ffn_gate_exps.weight", gate_up, qtype, index=(slice(None), slice(0, inter)))
        put(b + "ffn_up_exps.weight", gate_up, qtype, index=(slice(None), slice(inter, 2 * inter)))
        put(b + "ffn_down_exps.weight", p + "mlp.experts.down_proj", qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return oracle.eval()

"""Tiny Llama GGUF files written the way llama.cpp's converter writes them (Q/K rows permuted for its
RoPE layout), with the bundled model's byte-level BPE tokenizer, in a chosen block quantization (one
type for every linear, or one per tensor name: `q4_k_m`, llama.cpp's Q4_K_M choice). K-quants
(256-weight super-blocks) need hidden and MLP sizes that are multiples of 256: `tiny_llama(big=True)`."""

import json

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.loader.default import DEFAULT_MODEL_DIR

VOCAB = 4096


def tiny_llama(seed: int = 0, tied: bool = True, big: bool = False) -> LlamaForCausalLM:
    """hidden 64, MLP 160 (K = 160: whole 64-value pairs plus a lone 32-block), 2 layers, 4 heads / 2 KV;
    `big`: hidden 256, MLP 512 (whole K-quant super-blocks)."""
    torch.manual_seed(seed)
    hidden, mlp = (256, 512) if big else (64, 160)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1 so a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q4_k_m(name: str, n_layers: int):
    """llama.cpp's Q4_K_M type for a tensor (llama_tensor_get_type): Q6_K for the LM head, and for
    attn_v / ffn_down in its "more bits" layers (the first and last eighth, every third between), Q4_K
    for the rest."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if name == "output.weight":
        return Q.Q6_K
    if ".attn_v." in name or ".ffn_down." in name:
        i = int(name.split(".")[1])
        more = i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2
        return Q.Q6_K if more else Q.Q4_K
    return Q.Q4_K


def write_llama_gguf(path, model: LlamaForCausalLM, qtype, embed_qtype=None):
    """`model` as a llama.cpp GGUF file: linears (and the embedding, `embed_qtype` or `qtype`) in `qtype`,
    or in `qtype(name)` when it is a function of the tensor's name."""
    import gguf
    from gguf import quants
    from kquants import quantize as quantize_k

    k_types = {gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K}

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]) if getattr(cfg, "rope_parameters", None)
                         else float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tok = json.loads((DEFAULT_MODEL_DIR / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t.startswith("<|") else 1 for t, _ in vocab])
    w.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)

    def put(name, t: torch.Tensor, q=None):
        a = t.detach().float().numpy()
        if callable(q) and not isinstance(q, gguf.GGMLQuantizationType):
            q = q(name)
        if q is None or a.ndim == 1:
            w.add_tensor(name, a)
        elif q == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, (quantize_k if q in k_types else quants.quantize)(a, q), raw_dtype=q)

    sd = model.state_dict()
    put("token_embd.weight", sd["model.embed_tokens.weight"], embed_qtype or qtype)
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"], qtype)
    put("output_norm.weight", sd["model.norm.weight"])
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        put(f"blk.{i}.attn_q.weight", torch.from_numpy(_permute(sd[p + "self_attn.q_proj.weight"].numpy(), nh)), qtype)
        put(f"blk.{i}.attn_k.weight", torch.from_numpy(_permute(sd[p + "self_attn.k_proj.weight"].numpy(), nkv)), qtype)
        put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"], qtype)
        put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"], qtype)
        put(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"], qtype)
        put(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"], qtype)
        put(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"], qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

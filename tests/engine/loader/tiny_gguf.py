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


def tiny_qwen3(seed: int = 0, tied: bool = True, big: bool = False):
    """hidden 64, 4 heads of 32 (a head size that is not hidden / heads: the file must say it), MLP 160, 2 layers;
    norms (q_norm and k_norm too) away from 1. `big`: hidden 256, heads of 128, MLP 512 (whole K-quant blocks)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    hidden, head_dim, mlp = (256, 128, 512) if big else (64, 32, 160)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256,
                      rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    return _norms_away(Qwen3ForCausalLM(cfg).eval(), 0.5, 1.5)


def tiny_gemma3(seed: int = 0, big: bool = False):
    """hidden 64, 4 heads of 32, MLP 160, 2 layers: a local one (window 4) and a global one (the file's pattern
    says period 2), a soft-cap; norms away from Gemma's 0 (w: the model scales by 1 + w). `big`: Gemma-3-1B's
    proportions, hidden 192 (not whole 256-weight super-blocks, as 1,152 is not), 4 heads of 64, MLP 512."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    hidden, head_dim, mlp = (192, 64, 512) if big else (64, 32, 160)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256,
                           rms_norm_eps=1e-6, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                           query_pre_attn_scalar=head_dim, final_logit_softcapping=30.0, bos_token_id=1, eos_token_id=2)
    return _norms_away(Gemma3ForCausalLM(cfg).eval(), -0.5, 0.5)


def gemma3_q4_k_m(cfg):
    """llama-quantize's Q4_K_M choice for a Gemma 3 file of `cfg`: `q4_k_m`'s, except where a tensor's rows are
    not whole 256-weight super-blocks (Gemma's hidden size): there its fallback, Q5_0 for Q4_K, Q8_0 for Q6_K."""
    import gguf

    Q = gguf.GGMLQuantizationType

    def qtype(name: str):
        q = q4_k_m(name, cfg.num_hidden_layers)
        k = (cfg.intermediate_size if ".ffn_down." in name else cfg.num_attention_heads * cfg.head_dim
             if ".attn_output." in name else cfg.hidden_size)
        return q if k % 256 == 0 else {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}[q]

    return qtype


def tiny_gemma2(seed: int = 0):
    """An architecture without a native forward (Gemma 2: attention logit soft-capping), for the fallback."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                       sliding_window=4, query_pre_attn_scalar=256, bos_token_id=1, eos_token_id=2)
    return _norms_away(Gemma2ForCausalLM(cfg).eval(), -0.5, 0.5)


def _norms_away(model, lo: float, hi: float):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(lo, hi)
    return model


def add_default_tokenizer(w) -> None:
    """The bundled model's byte-level BPE tokenizer as a GGUF writer's `tokenizer.ggml.*` metadata."""
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


def write_llama_gguf(path, model: LlamaForCausalLM, qtype, embed_qtype=None):
    """`model` (a Llama, Qwen3 or Gemma 3) as a llama.cpp GGUF file: linears (and the embedding, `embed_qtype`
    or `qtype`) in `qtype`, or in `qtype(name)` when it is a function of the tensor's name."""
    import gguf
    from gguf import quants
    from kquants import quantize as quantize_k

    k_types = {gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K}

    cfg = model.config
    arch = {"llama": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3", "gemma2": "gemma2"}[cfg.model_type]
    gemma = arch.startswith("gemma")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if arch != "llama":  # what convert_hf_to_gguf.py writes for Qwen3 and Gemma 3
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if gemma:
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        w.add_sliding_window_pattern(2)  # layer 0 local, layer 1 global (llama.cpp's default period is 6)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    add_default_tokenizer(w)

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

    sd = {k: v + 1 if gemma and k.endswith("norm.weight") else v  # llama.cpp stores Gemma's 1 + w
          for k, v in model.state_dict().items()}
    put("token_embd.weight", sd["model.embed_tokens.weight"], embed_qtype or qtype)
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"], qtype)
    put("output_norm.weight", sd["model.norm.weight"])
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        if gemma:
            put(f"blk.{i}.post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"])
            put(f"blk.{i}.ffn_norm.weight", sd[p + "pre_feedforward_layernorm.weight"])
            put(f"blk.{i}.post_ffw_norm.weight", sd[p + "post_feedforward_layernorm.weight"])
        else:
            put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        if arch in ("qwen3", "gemma3"):
            put(f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
            put(f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "llama":  # only llama's converter permutes Q and K for its RoPE layout
            q, k = torch.from_numpy(_permute(q.numpy(), nh)), torch.from_numpy(_permute(k.numpy(), nkv))
        put(f"blk.{i}.attn_q.weight", q, qtype)
        put(f"blk.{i}.attn_k.weight", k, qtype)
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

"""Tiny seeded random models of every supported architecture, built from configs (no downloads)."""

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 101


def _llama_gqa():
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    )


def _qwen2():
    return Qwen2ForCausalLM(
        Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256)
    )


def _qwen2_sliding():
    # window 4 on layer 1 only (max_window_layers=1): a hybrid model whose mask is a dict per layer type
    return Qwen2ForCausalLM(
        Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    use_sliding_window=True, sliding_window=4, max_window_layers=1)
    )


def _mistral():
    return MistralForCausalLM(
        MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=5)
    )


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                      bos_token_id=1, eos_token_id=2))


BUILDERS = {
    "llama_gqa": _llama_gqa,
    "qwen2": _qwen2,
    "qwen2_sliding": _qwen2_sliding,
    "mistral": _mistral,
    "gpt2": _gpt2,
}


def tiny_model(name: str, attn: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    model = BUILDERS[name]()
    model.set_attn_implementation(attn)
    return model.eval()


def full_logits(model, token_ids) -> torch.Tensor:
    """The oracle: a cacheless forward over a whole token history, logits of every row."""
    with torch.no_grad():
        return model(torch.tensor([token_ids]), use_cache=False).logits[0].float()

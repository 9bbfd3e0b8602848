"""Tiny seeded random models of every supported architecture, built from configs (no downloads)."""

import itertools

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
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


def _random_norms(model):
    """Norm weights away from their init (ones, or Gemma's zeros) so a misplaced or missing norm shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if "gemma" in model.config.model_type else p.uniform_(0.5, 1.5)
    return model


def _qwen3():
    # head_dim 16 with hidden 32 / 4 heads (Qwen3's head_dim is its own: 128 beside hidden 1024 / 16 heads)
    return _random_norms(Qwen3ForCausalLM(
        Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)))


def _gemma3():
    # a local (window 4, base 10k) and a global layer (base 1M); query_pre_attn_scalar not head_dim; a soft-cap
    return _random_norms(Gemma3ForCausalLM(
        Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                         query_pre_attn_scalar=24, final_logit_softcapping=30.0)))


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                      bos_token_id=1, eos_token_id=2))


BUILDERS = {
    "llama_gqa": _llama_gqa,
    "qwen2": _qwen2,
    "qwen2_sliding": _qwen2_sliding,
    "mistral": _mistral,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
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


CORPUS = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "JULIET: O Romeo, Romeo, wherefore art thou Romeo?",
    "Naïve café déjà vu — 日本語のテキスト, emoji 🎉🚀 and ünïcödé.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer():
    """A byte-level BPE (any Unicode round-trips) with BOS/EOS and a chat template, trained offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
                                  special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"])
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", chat_template=CHAT_TEMPLATE)


def save_tiny_model_dir(path, seed: int = 0, max_positions: int = 512):
    """A tiny seeded Llama (GQA) plus tokenizer saved as a Hugging Face folder; returns the path."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_scripted_model_dir(path, chat_template: str, after: str, script: str, seed: int = 0):
    """A tiny Llama that writes `script` (then EOS) under greedy decoding after any prompt ending in the
    last token of `after`: its layers add nothing (zero output projections), so each position's logits
    depend on its own token only, and the head maps every token of the chain `after[-1], script..., EOS`
    to its successor. `<think>`/`</think>` are plain added tokens (as Qwen3's: not skipped when decoding),
    `<|im_start|>`/`<|im_end|>` special ones. For tests of what a server does with a known reply (a
    reasoning split) through APIs that take no grammar. Returns (path, the script's token ids)."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = chat_template
    said = tokenizer.encode(script, add_special_tokens=False)
    chain = [tokenizer.encode(after, add_special_tokens=False)[-1], *said, tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), f"the script's tokens must be distinct: {chain}"
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.nn.functional.normalize(torch.randn(len(tokenizer), 64), dim=1)
        head = torch.nn.functional.normalize(torch.randn(len(tokenizer), 64), dim=1)
        for cur, nxt in itertools.pairwise(chain):
            head[nxt] = emb[cur]
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(10 * head)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), said

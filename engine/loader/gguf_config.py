"""The transformers config of a GGUF file the native forward runs, read from the file's own metadata.

transformers' GGUF config mapping misses what the native forward needs for the newer families (it reads no
`attention.key_length` for Qwen3, so a Qwen3 whose head size is not hidden / heads gets the default 128; for
Gemma 3 it reads neither the local/global layer pattern nor the local RoPE base), so for the architectures in
`CONFIG_ARCHS` the config is written here, key by key, from llama.cpp's metadata (gguf-py's key names):
- every family: sizes, heads, KV heads, head size (`attention.key_length`, else hidden / heads), context length,
  RMSNorm epsilon, RoPE base (`rope.freq_base`), the vocabulary (the embedding's rows), a tied head (no
  `output.weight`), the special token ids;
- Gemma 3: the window (`attention.sliding_window`), which layers are local (`attention.sliding_window_pattern`:
  a period, every period-th layer global, or one bool per layer; llama.cpp's default for gemma3 is 6), the local
  RoPE base 10,000 and the query scale llama.cpp uses (1/sqrt(head size), or 1/sqrt(hidden / heads) for the
  62-layer 27B), a final logit soft-cap where the file has one.
A RoPE scaling type the forward does not implement is a clear error, not a silent guess.
"""

from engine.api.errors import ModelSourceError

CONFIG_ARCHS = ("qwen3", "gemma3")
GEMMA3_PATTERN = 6  # llama.cpp: every sixth gemma3 layer is global (hparams.set_swa_pattern(6))
GEMMA3_LOCAL_BASE = 10000.0


def config_from_metadata(meta: dict, n_vocab: int, tied: bool):
    """The transformers config of a `CONFIG_ARCHS` file's metadata; `n_vocab`: the embedding's rows."""
    from transformers import Gemma3TextConfig, Qwen3Config

    arch = meta["general.architecture"]
    if arch not in CONFIG_ARCHS:
        raise ValueError(f"no config reader for GGUF architecture {arch!r} (only {', '.join(CONFIG_ARCHS)})")

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelSourceError(f"the GGUF file has no {arch}.{key}; it is incomplete or not a {arch} model file")
        return value

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ModelSourceError(f"the {arch} GGUF file asks for RoPE scaling {scaling!r}, which the native forward "
                               f"does not implement; serve a file without it")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    n_layers = int(get("block_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ModelSourceError(f"the {arch} GGUF file has a KV head count per layer; only one for every layer is read")
    head_dim = int(get("attention.key_length", hidden // heads))
    common = dict(vocab_size=n_vocab, hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
                  num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=int(kv_heads),
                  head_dim=head_dim, max_position_embeddings=int(get("context_length")),
                  rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")), tie_word_embeddings=tied,
                  **_special_ids(meta))
    base = float(get("rope.freq_base", 10000.0 if arch == "gemma3" else 1000000.0))
    if arch == "qwen3":
        return Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": base}, **common)
    sliding = _sliding_layers(meta.get(f"{arch}.attention.sliding_window_pattern", GEMMA3_PATTERN), n_layers)
    scalar = hidden // heads if n_layers == 62 else head_dim
    return Gemma3TextConfig(
        sliding_window=int(get("attention.sliding_window")),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_BASE},
                         "full_attention": {"rope_type": "default", "rope_theta": base}},
        query_pre_attn_scalar=scalar, final_logit_softcapping=meta.get(f"{arch}.final_logit_softcapping"),
        hidden_activation="gelu_pytorch_tanh", **common)


def _sliding_layers(pattern, n_layers: int) -> list[bool]:
    """Which layers are local: a period (llama.cpp's `set_swa_pattern(n)`: every n-th layer global) or a bool each."""
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ModelSourceError(f"the GGUF file's sliding_window_pattern has {len(pattern)} entries for "
                                   f"{n_layers} layers")
        return [bool(s) for s in pattern]
    period = int(pattern)
    return [period == 0 or (i + 1) % period != 0 for i in range(n_layers)]


def _special_ids(meta: dict) -> dict:
    names = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
    return {k: int(meta[f"tokenizer.ggml.{v}"]) for k, v in names.items() if f"tokenizer.ggml.{v}" in meta}

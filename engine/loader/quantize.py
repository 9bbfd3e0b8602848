"""`--quantize int8|int4` for any Hugging Face folder of a Llama-family model: weight-only, 32-weight groups.

The float linears (q/k/v/o, gate/up/down and the LM head) are read one tensor at a time from the folder's
safetensors and quantized at load into GGUF's own 32-weight block formats, so they run on the same
kernels and the same native forward as a quantized GGUF file (`QuantWeight`, engine/loader/gguf_tensors.py;
engine/model/native/quant.py): `load_quantized_folder` returns the `tensors` dict `load_quantized` returns
for a GGUF file (llama.cpp names) and a placeholder model skeleton. No float copy of a quantized matrix is
kept; the embedding, the norms and the biases stay float (the embedding in float32, or bfloat16 when the
checkpoint or `dtype` is bfloat16/float16), except that a tied embedding shares the quantized head's
blocks (rows dequantized per lookup), as tied GGUF files do.

Formats (`FORMATS`), per block of 32 consecutive weights x of one row, rounded by gguf-py's
`quants.quantize` (numpy; the same bytes as ggml-quants.c's `quantize_row_*_ref`), then repacked for the
kernels (`pack_blocks`); the tests check the bytes against these rules written out in torch. d and m are
stored as fp16, q is computed with the float32 d:
  int8 -> Q8_0: d = max|x| / 127, q = roundf(x / d) (half away from zero) in [-127, 127], w = d q.
        |x - w| <= d/2 + 127 |d - fp16(d)|: about 0.53 d.                       1.0625 bytes a weight
  int4 -> Q4_1: d = (max x - min x) / 15, m = min x, q = trunc((x - m) / d + 0.5) clamped to [0, 15],
        w = d q + m.  |x - w| <= d/2 + 15 |d - fp16(d)| + |m - fp16(m)|.       0.625 bytes a weight
  (Q4_0, the other 4-bit format: d = x_amax / -8 with x_amax the signed value of largest magnitude,
   q = trunc(x / d + 8.5) clamped to [0, 15], w = d (q - 8); the value opposite x_amax lands on q = 16
   and is clamped, an error of a whole |d|. On the bundled model's linears Q4_1's relative RMS error is
   7.8% against Q4_0's 8.6%, and its perplexity on held-out text +0.08% against +0.24% (head Q8_0), for
   11% more bytes (0.625 against 0.5625 a weight), so int4 is Q4_1: docs/performance.md.)
The LM head is Q8_0 in both modes (`HEAD_FORMAT`): in 4 bits it cost the bundled model +0.41% perplexity
(Q4_1) against +0.08% in Q8_0 and +0.09% kept float32, and SmolLM2 +5.4% against +0.5%
(`python -m engine.bench.quantize --perplexity`).
A matrix whose input size is not a multiple of 32 stays float (logged once per load): a layer's in
bfloat16, the head as the embedding.

Per-block rounding only: no calibration data, no error feedback. The quantized weights differ from the
float ones by the bounds above, and with the kernels' per-32 int8 rounding of the activations (engine/
model/native/quant.py) the logits move by the amounts docs/performance.md and the tests state.
"""

import hashlib
import json
import logging
import re
from pathlib import Path

import torch

from engine.api.errors import ModelSourceError
from engine.loader.gguf_tensors import Q4_0, Q4_1, Q8_0, QuantWeight, pack_blocks, placeholder_model

log = logging.getLogger("cellserve.quantize")

GROUP = 32  # weights per block: one scale (and a minimum for Q4_1) per 32
FORMATS = {"int8": "q8_0", "int4": "q4_1"}  # --quantize -> the block format the linears are stored in
HEAD_FORMAT = "q8_0"  # the LM head's (and a tied embedding's), whichever the mode
GGML_TYPES = {"q8_0": Q8_0, "q4_0": Q4_0, "q4_1": Q4_1}  # the block kinds quantize_weight makes
CHUNK_ELEMENTS = 1 << 22  # rows quantized at once: at most ~16 MB of float32 temporaries per step

# Hugging Face parameter names -> llama.cpp's (the names quant.layer_weights/model_weights read)
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight"}  # Qwen3's per-head norms
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_REQUIRED = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight"}
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def gguf_name(hf_name: str) -> str | None:
    """The llama.cpp name of a Llama-family parameter (None for anything else, e.g. rotary buffers)."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    m = _LAYER_RE.fullmatch(hf_name)
    if not m:
        return None
    i, rest = m.groups()
    if rest in _LAYER:
        return f"blk.{i}.{_LAYER[rest]}"
    module, _, param = rest.rpartition(".")
    return f"blk.{i}.{_LAYER[module]}.{param}" if module in _LAYER and param in ("weight", "bias") else None


def quantize_weight(w: torch.Tensor, kind: str) -> QuantWeight:
    """A float [N, K] matrix (K a multiple of 32) as a `QuantWeight` of `kind` ("q8_0", "q4_0", "q4_1"):
    gguf-py's reference quantizer (numpy, the module docstring's rules) then the kernels' repacking
    (`pack_blocks`), a chunk of rows at a time (float32 temporaries stay ~16 MB whatever the matrix)."""
    from gguf import GGMLQuantizationType, quants

    n, k = w.shape
    if kind not in GGML_TYPES:
        raise ValueError(f"no quantizer for {kind!r}: use one of {', '.join(GGML_TYPES)}")
    if k % GROUP:
        raise ValueError(f"a [{n}, {k}] matrix cannot be quantized in blocks of {GROUP}: {k} is not a multiple")
    qtype, step = GGML_TYPES[kind], max(1, CHUNK_ELEMENTS // k)
    parts = []
    for r in range(0, n, step):
        rows = w[r:r + step].detach().float().numpy()
        parts.append(pack_blocks(quants.quantize(rows, GGMLQuantizationType(qtype)), qtype, rows.shape[0], k))
    return QuantWeight.cat(parts)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"{folder} has no .safetensors weights; --quantize reads safetensors folders "
                               f"(save the model with save_pretrained(safe_serialization=True))")
    return files


def _float_dtype(dtype, stored: torch.dtype) -> torch.dtype:
    """The dtype the matrices kept float are held in: float32, or bfloat16 for a bf16/fp16 choice."""
    name = str(stored if dtype in ("auto", None) else dtype).removeprefix("torch.")
    return torch.float32 if name == "float32" else torch.bfloat16


def _tensors(path: Path):
    """(name, tensor) of the Llama-family parameters in one safetensors file, one at a time; the file is
    mapped only while one tensor is read, so its pages do not stay resident (a float copy of the model
    in RSS) while the rest are quantized."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        names = [n for n in f.keys() if gguf_name(n) is not None]  # noqa: SIM118 (safe_open is not iterable)
    for hf_name in names:
        with safe_open(path, framework="pt") as f:
            yield hf_name, f.get_tensor(hf_name)


def read_quantized(folder: str | Path, mode: str, dtype="auto", *, head: str | None = HEAD_FORMAT,
                   linears: str | None = None) -> dict:
    """The folder's Llama-family tensors by llama.cpp name: the linears as `QuantWeight`s of
    `FORMATS[mode]` (or the block kind `linears`), the LM head in the block kind `head` (None: float),
    norms and biases in float32, the embedding (and a float head) in `_float_dtype(dtype)`."""
    out: dict = {}
    kept_float: list[str] = []
    for path in _safetensors_files(Path(folder)):
        for hf_name, t in _tensors(path):
            name = gguf_name(hf_name)
            kind = (linears or FORMATS[mode]) if name.split(".")[-2] in LINEARS else \
                head if name == "output.weight" else None
            quantize = kind is not None and name.endswith(".weight")
            if quantize and t.shape[1] % GROUP == 0:
                out[name] = quantize_weight(t, kind)
            elif t.dim() == 1:  # copies, never views of the file's mapping
                out[name] = t.to(torch.float32, copy=True)
            elif quantize and name != "output.weight":  # a layer's linear left float: bf16 (CastLinear)
                kept_float.append(name)
                out[name] = t.to(torch.bfloat16, copy=True)
            else:
                kept_float += [name] if quantize else []
                out[name] = t.to(_float_dtype(dtype, t.dtype), copy=True)
    if kept_float:
        log.warning("%s: %d matrices have an input size that is not a multiple of %d and stay float (%s, ...)",
                    folder, len(kept_float), GROUP, kept_float[0])
    return out


def _tie(tensors: dict, config, head: str | None) -> None:
    """A tied head reads the embedding: its table quantized to `head` (None: the float table). A tied
    checkpoint that also saved `lm_head.weight` (the same matrix) keeps one copy."""
    if not getattr(config, "tie_word_embeddings", False):
        return
    tensors.pop("output.weight", None)
    embed = tensors["token_embd.weight"]
    if head and not isinstance(embed, QuantWeight) and embed.shape[1] % GROUP == 0:
        tensors["token_embd.weight"] = quantize_weight(embed, head)


def fingerprint(tensors: dict) -> str:
    """A hash of an evenly strided sample (<= 4,096 values) of every tensor, the blocks' scales for a
    `QuantWeight`: milliseconds, and different for any other weights."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].d if isinstance(tensors[name], QuantWeight) else tensors[name]
        flat = t.reshape(-1)
        h.update(name.encode() + flat[:: max(1, flat.numel() // 4096)].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def load_quantized_folder(folder: str | Path, mode: str, dtype="auto", *, check=None,
                          head: str | None = HEAD_FORMAT, linears: str | None = None):
    """(model skeleton, tokenizer, tensors) of a Hugging Face folder, quantized to `mode` ("int8", "int4").

    `check(skeleton)` returns why the native forward cannot run this model (None when it can); it is
    asked before any weight is read, so an unsupported model fails fast with that reason. `head`: the
    LM head's block kind (None keeps it, and a tied embedding, float); `linears`: the layers' block kind
    instead of `FORMATS[mode]` (the benchmark's comparison of formats). The skeleton's config records
    the formats and a fingerprint, so saved cells (engine/core/state) of one mode or of other weights are
    never restored into this model (its parameters are placeholders: the identity's sample of them says
    nothing)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    if mode not in FORMATS:
        raise ModelSourceError(f"quantize={mode!r}: use one of none, {', '.join(FORMATS)}")
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelSourceError(f"{folder} is not a model folder: it has no config.json")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    model = placeholder_model(config)
    reason = check(model) if check else None
    if reason is None and config.model_type.startswith("gemma"):  # its (1 + w) and sandwich norms are not mapped here
        reason = f"{config.model_type}'s norms are not mapped for --quantize (a GGUF file of it runs quantized)"
    if reason is None and (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)):
        reason = (f"{config.model_type}'s experts are not mapped for --quantize (a GGUF file of it runs quantized; "
                  f"the float folder runs on the native forward as it is)")
    if reason:
        raise ModelSourceError(f"--quantize {mode} runs on the native Llama-family forward, which cannot run "
                               f"{folder.name}: {reason}; serve it without --quantize")
    tensors = read_quantized(folder, mode, dtype, head=head, linears=linears)
    _tie(tensors, config, head)
    missing = [hf for hf, name in _REQUIRED.items() if name not in tensors]
    if missing:
        raise ModelSourceError(f"{folder}: its safetensors have no {missing[0]}; --quantize reads Llama-family "
                               f"checkpoints under transformers' names")
    model.config.cellserve_quantize = {"linears": linears or FORMATS[mode], "head": head or "float",
                                       "fingerprint": fingerprint(tensors)}
    if (folder / "generation_config.json").is_file():  # its EOS ids, as from_pretrained would read them
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer, tensors

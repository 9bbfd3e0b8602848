"""K-quant GGUF files served quantized: a Q4_K_M-like file (Q4_K linears and embedding, Q6_K LM head,
attn_v and ffn_down in its "more bits" layer, so Q|K|V mixes two kinds), an all-Q5_K file with a tied
head, and a file with types the kernels do not read (TQ2_0, F16), served as bfloat16 per tensor (Q5_0 and Q5_1
are tests/engine/model/test_quant_linear.py's and test_gguf_families.py's Gemma 3 files').
The oracle: the same file dequantized to float32 by transformers (`from_pretrained(gguf_file=...)`).

Tolerances, and why:
- quantized kinds only (q4_k_m, q5_k): the eager path and every many-row call equal the oracle's
  arithmetic up to fp32 summation order: atol 1e-4 on the logits (prefill). With the kernels, 1-8-row
  calls round activations to int8, per 256-weight super-block for the K-quants (llama.cpp's q8_K;
  tests/engine/model/test_quant_linear.py bounds it per linear): through 2 layers (hidden 256) and the
  head the logits moved by < 0.03 when measured; asserted at 0.05, and the greedy tokens must be the
  oracle's at all but at most one of the 12 decode steps (a near-tie the rounding may flip: measured
  once, a gap of 0.012 under an error of 0.018).
- fallback: the bf16 tensors round each weight to 8 significant bits (relative 2^-9): the logits moved
  by < 0.02 when measured (prefill and decode); asserted at 0.05, greedy tokens as above.
"""

import logging

import gguf
import numpy as np
import pytest
import torch
from tiny_gguf import q4_k_m, tiny_llama, write_llama_gguf
from tiny_models import full_logits
from transformers import AutoModelForCausalLM

from engine.loader.gguf_tensors import quantized_share, read_tensor_index
from engine.loader.source import resolve_model
from engine.model.kernels import build as kernels
from engine.model.native.quant import CastEmbedding, CastLinear, GroupLinear, QuantLinear, weight_bytes
from engine.model.runner import ModelRunner

Q = gguf.GGMLQuantizationType
ATOL = 0.05


def _fallback(name: str):
    if ".attn_v." in name:
        return Q.TQ2_0  # Q|K|V: two q4_k parts and a bf16 one
    if ".ffn_up." in name:
        return Q.F16
    return Q.TQ2_0 if name == "output.weight" else Q.Q4_K


CASES = {  # name: (linear types, embedding type, tied head)
    "q4_k_m": (lambda name: q4_k_m(name, 2), None, False),
    "q5_k": (Q.Q5_K, Q.Q5_K, True),
    "fallback": (_fallback, Q.F16, False),
}


@pytest.fixture(scope="module", params=list(CASES))
def served(request, tmp_path_factory):
    qtype, etype, tied = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    path = write_llama_gguf(d / "tiny.gguf", tiny_llama(seed=2, tied=tied, big=True), qtype, etype)
    folder = resolve_model(str(path), "quantized", home=d / "home", progress=False).path
    oracle = AutoModelForCausalLM.from_pretrained(d, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    return request.param, path, folder, oracle


def _prompt(n, seed=0):
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _file_bytes(path) -> int:
    _, index = read_tensor_index(path)
    return sum(int(np.prod(t.shape)) // gguf.GGML_QUANT_SIZES[Q(t.ggml_type)][0]
               * gguf.GGML_QUANT_SIZES[Q(t.ggml_type)][1] for t in index.values())


def test_kinds_kept_and_bytes(served, caplog):
    name, path, folder, _ = served
    with caplog.at_level(logging.WARNING, logger="cellserve.gguf"):
        runner = ModelRunner.from_pretrained(folder, n_cells=128)
    native = runner.native
    layers = native.layers
    warned = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    n_params = sum(p.numel() for p in runner.model.parameters())
    if name == "q4_k_m":
        assert not warned
        assert layers[0].qkv.weight.kind == "q4_k"
        assert isinstance(layers[1].qkv, GroupLinear)  # Q|K in q4_k, V in q6_k
        assert [p.weight.kind for p in layers[1].qkv.parts] == ["q4_k", "q6_k"]
        assert layers[1].mlp.down.weight.kind == "q6_k" and layers[0].mlp.down.weight.kind == "q4_k"
        assert layers[0].mlp.gate_up.weight.kind == "q4_k"
        assert native.head.weight.kind == "q6_k" and native.embed.weight.kind == "q4_k"
        # the file's bytes, + 4 bytes a q4_k super-block (its 12 packed scale bytes kept as 16)
        q4k = sum(int(np.prod(t.shape)) for t in read_tensor_index(path)[1].values() if t.ggml_type == Q.Q4_K)
        assert weight_bytes(native) == _file_bytes(path) + q4k // 256 * 4
        assert weight_bytes(native) < 0.2 * 4 * n_params
    elif name == "q5_k":
        assert not warned
        assert native.head.weight is native.embed.weight and native.head.weight.kind == "q5_k"
        assert all(isinstance(lin, QuantLinear) and lin.weight.kind == "q5_k" for lay in layers for lin in lay.linears())
    else:
        assert len(warned) == 1 and "F16, TQ2_0" in warned[0]  # logged once, every type named
        assert isinstance(native.embed, CastEmbedding) and native.embed.weight.dtype == torch.bfloat16
        assert isinstance(native.head, CastLinear)
        assert [type(p) for p in layers[0].qkv.parts] == [QuantLinear, CastLinear]
        assert [type(p) for p in layers[0].mlp.gate_up.parts] == [QuantLinear, CastLinear]
        assert weight_bytes(native) < 0.5 * 4 * n_params  # no float32 copies of the bf16 tensors


@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "eager"])
def test_logits_match_the_dequantized_oracle(served, fused):
    name, _, folder, oracle = served
    runner = ModelRunner.from_pretrained(folder, n_cells=128, kv_cache_dtype="model")  # the weights alone
    runner.native.fused = fused and kernels.load()
    hist = {0: _prompt(21, 1), 1: _prompt(6, 2)}
    small = runner.native.fused and torch.ops.cellserve.quant_linear_fast()
    prefill_atol = 1e-4 if name != "fallback" and not small else ATOL
    out = runner.run({0: (hist[0], 0), 1: (hist[1], 0)})
    for s in (0, 1):
        torch.testing.assert_close(out[s], full_logits(oracle, hist[s])[-1], atol=prefill_atol, rtol=0)
    worst, flips = 0.0, 0
    for step in range(8):  # one row, then two
        seqs = (0,) if step < 4 else (0, 1)
        nxt = {s: int(out[s].argmax()) for s in seqs}
        out |= runner.run({s: ([nxt[s]], len(hist[s])) for s in seqs})
        for s in seqs:
            hist[s].append(nxt[s])
            want = full_logits(oracle, hist[s])[-1]
            worst = max(worst, float((out[s] - want).abs().max()))
            torch.testing.assert_close(out[s], want, atol=ATOL if small or name == "fallback" else 1e-4, rtol=0)
            flips += int(out[s].argmax()) != int(want.argmax())
    print(f"{name} decode logits max |diff| {worst:.4f}, greedy flips {flips} of 12")
    assert flips <= 1  # a near-tie at most (the logits' bound above holds at every step regardless)


def test_quantized_share(served):
    name, path, _, _ = served
    share = quantized_share(path)
    assert share == 1.0 if name != "fallback" else 0.0 < share < 1.0

"""A GGUF file served quantized (dtype "quantized"): its Q8_0 / Q4_0 / Q4_1 blocks are the only copy of
the linears, and the native forward's logits match the same weights dequantized through transformers
(the oracle: `from_pretrained(gguf_file=...)`).

Tolerances, and why:
- the eager path (no kernels: every linear dequantizes fp32 tiles, then torch.mm, as the kernels'
  many-row path does): the oracle's own arithmetic up to fp32 summation order: atol 1e-4 on the logits.
- with the kernels, any linear called with 1 to 8 rows (decode, and the LM head over the few last
  rows of a prefill) rounds its activations per 32-block to int8, as llama.cpp does: each linear's output
  moves by at most sum |w| * da / 2 (tests/engine/model/test_quant_linear.py); through 2 layers and the
  head of these tiny models the logits moved by < 0.01 when measured (0.005-0.006), asserted at 0.05,
  and the greedy tokens must be the oracle's.
"""

import json

import gguf
import numpy as np
import pytest
import torch
from tiny_gguf import tiny_llama, write_llama_gguf
from tiny_models import full_logits
from transformers import AutoModelForCausalLM

from engine.api.sampling_params import SamplingParams
from engine.core.llm import LLM
from engine.loader.gguf_tensors import QuantWeight, read_tensor_index
from engine.loader.source import resolve_model
from engine.model.kernels import build as kernels
from engine.model.native.quant import QuantLinear, weight_bytes
from engine.model.native.quant_tiles import TiledWeight
from engine.model.runner import ModelRunner

Q = gguf.GGMLQuantizationType
DECODE_ATOL = 0.05
CASES = {  # name: (linears, embedding, tied head)
    "q8_0": (Q.Q8_0, Q.Q8_0, False),
    "q4_1": (Q.Q4_1, Q.Q8_0, True),  # SmolLM2's file: Q4_1 linears, a Q8_0 embedding read as the head
    "q4_0": (Q.Q4_0, Q.Q4_0, True),
}


@pytest.fixture(scope="module", params=list(CASES))
def served(request, tmp_path_factory):
    qtype, etype, tied = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    path = write_llama_gguf(d / "tiny.gguf", tiny_llama(seed=1, tied=tied), qtype, etype)
    folder = resolve_model(str(path), "quantized", home=d / "home", progress=False).path
    oracle = AutoModelForCausalLM.from_pretrained(d, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    return request.param, path, folder, oracle


def _prompt(n, seed=0):
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_folder_holds_no_weights_and_the_runner_one_copy(served):
    kind, path, folder, _ = served
    info = json.loads((folder / "cellserve.json").read_text())
    assert info["weights"] == "gguf" and info["dtype"] == "quantized" and info["gguf"] == str(path.resolve())
    assert not list(folder.glob("*.safetensors"))
    runner = ModelRunner.from_pretrained(folder, n_cells=128)
    native = runner.native
    assert native is not None
    linears = [lin for layer in native.layers for lin in layer.linears()] + [native.head]
    assert all(isinstance(lin, QuantLinear) for lin in linears)
    assert {lin.weight.kind for layer in native.layers for lin in layer.linears()} == {kind}
    # bytes: exactly the file's tensor bytes (the tied head reads the embedding's blocks), not float32's
    _, index = read_tensor_index(path)
    file_bytes = sum(int(np.prod(t.shape)) // gguf.GGML_QUANT_SIZES[Q(t.ggml_type)][0]
                     * gguf.GGML_QUANT_SIZES[Q(t.ggml_type)][1] for t in index.values())
    # + the 32-weight kinds' tile padding (engine/model/native/quant_tiles.py: zero rows to whole 16-row tiles
    # per part; none where a part's rows are a multiple of 16, as in real models)
    tiled = {id(lin.weight): lin.weight for lin in linears if isinstance(lin.weight, TiledWeight)}.values()
    padding = sum(w.padding for w in tiled)
    assert weight_bytes(native) == file_bytes + padding
    n_params = sum(p.numel() for p in runner.model.parameters())
    assert file_bytes < 0.3 * 4 * n_params  # against float32's 4 bytes a weight
    # the transformers modules hold placeholders only (a broadcast scalar each), no second copy
    assert sum(p.untyped_storage().nbytes() for p in runner.model.parameters()) <= 4 * len(list(runner.model.parameters()))
    if CASES[kind][2]:
        assert native.head.weight is native.embed.weight and isinstance(native.embed.weight, (QuantWeight, TiledWeight))


def test_a_load_holds_one_copy_at_a_time(served):
    """The load's peak: the native forward takes each tensor out of the dict as its layer re-lays it (tiles), so
    the file's blocks and their re-laid copy are never all held at once; what the load freed goes back to the
    OS (engine/model/heap.py). (Tensors are also read one at a time, not through a map left resident.)"""
    from engine.loader.gguf_tensors import load_gguf_model
    from engine.model import heap
    from engine.model.native.model import NativeLlama

    folder = served[2]
    model, _, tensors = load_gguf_model(folder)
    assert tensors
    runner = ModelRunner(model, n_cells=64, native=False)  # its mask spec; the native forward built below
    native = NativeLlama(model, runner.spec, tensors)
    assert tensors == {}  # every tensor taken by a layer, the embedding, the norm or the head
    assert native.layers and native.head is not None
    assert heap.trim()  # glibc (this project's Linux images): the load's freed heap is returned


@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "eager"])
def test_logits_match_the_dequantized_oracle_and_greedy_tokens_agree(served, fused):
    _, _, folder, oracle = served
    runner = ModelRunner.from_pretrained(folder, n_cells=128, kv_cache_dtype="model")  # the weights alone
    assert runner.native.fused == kernels.load()
    runner.native.fused = fused and kernels.load()
    hist = {0: _prompt(21, 1), 1: _prompt(6, 2)}
    atol = DECODE_ATOL if runner.native.head.is_small(torch.empty(1, 1)) else 1e-4
    out = runner.run({0: (hist[0], 0), 1: (hist[1], 0)})  # prefill: 27 rows through dequantized tiles
    for s in (0, 1):
        torch.testing.assert_close(out[s], full_logits(oracle, hist[s])[-1], atol=atol, rtol=0)
    worst = 0.0
    for step in range(8):  # decode: one row (integer kernel with the fused kernels), then two rows
        seqs = (0,) if step < 4 else (0, 1)
        nxt = {s: int(out[s].argmax()) for s in seqs}
        out |= runner.run({s: ([nxt[s]], len(hist[s])) for s in seqs})
        for s in seqs:
            hist[s].append(nxt[s])
            want = full_logits(oracle, hist[s])[-1]
            torch.testing.assert_close(out[s], want, atol=atol, rtol=0)
            worst = max(worst, float((out[s] - want).abs().max()))
            assert int(out[s].argmax()) == int(want.argmax())
    print(f"decode logits max |diff| {worst:.4f}")


def test_llm_serves_a_gguf_quantized(served, monkeypatch, tmp_path):
    _, path, _, oracle = served
    monkeypatch.setenv("CELLSERVE_HOME", str(tmp_path))
    llm = LLM(str(path), dtype="quantized", n_cells=256, kv_cache_dtype="model")  # the weights alone
    assert llm.engine.runner.native.head.__class__ is QuantLinear
    prompt = _prompt(12, 5)
    got = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(full_logits(oracle, ids)[-1].argmax()))
    assert list(got.outputs[0].token_ids) == ids[len(prompt):]


def test_quantized_weights_get_int8_cells_by_default_and_model_keeps_float(served):
    """`--kv-cache-dtype auto` (the default) is int8 cells for quantized weights (a quantized file's
    activations are float32: float cells would be 4 bytes a value, twice llama.cpp's f16 cache); "model"
    keeps float32 cells. Both follow the dequantized oracle: within DECODE_ATOL (the weights' int8
    activations) plus, for int8 cells, 1% of the largest logit (their rounding: tests/engine/model/
    test_int8_kv_model.py), teacher-forced on the oracle's greedy tokens."""
    _, _, folder, oracle = served
    for choice, dtype in (("auto", torch.int8), ("int8", torch.int8), ("model", torch.float32)):
        runner = ModelRunner.from_pretrained(folder, n_cells=64, kv_cache_dtype=choice)
        assert runner.kv_cache_dtype == ("model" if choice == "model" else "int8")
        cfg = runner.config
        values = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
        if dtype == torch.float32:
            assert runner.cell_bytes == 4 * values
        else:  # one byte a value plus a float32 scale per (layer, kv head) row of K and of V
            assert values < runner.cell_bytes < 2 * values
        ids = _prompt(9, 3)
        out = runner.run({0: (ids, 0)})
        assert runner.cache.layers[0].keys.dtype == dtype
        for _ in range(4):
            want = full_logits(oracle, ids)[-1]
            slack = 0.01 * float(want.abs().max()) if dtype == torch.int8 else 0.0
            torch.testing.assert_close(out[0], want, atol=DECODE_ATOL + slack, rtol=0)
            nxt = int(want.argmax())
            out = runner.run({0: ([nxt], len(ids))})
            ids.append(nxt)


def test_a_float_folder_refuses_quantized(tmp_path):
    from engine.loader.default import DEFAULT_MODEL_DIR

    with pytest.raises(ValueError, match="quantized"):
        ModelRunner.from_pretrained(DEFAULT_MODEL_DIR, dtype="quantized")

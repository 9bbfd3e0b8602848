"""`quant_moe` (csrc/quant_experts.cpp): a mixture-of-experts block's K-quant experts in one kernel call.

- bitwise the per-expert loop it replaces (each active expert's rows through `quant_linear`'s row kernel, the
  weighted outputs `index_add_`ed in ascending expert order), at one row and at several rows sharing experts;
- each row bitwise as alone, whatever the other rows of the call are (row invariance: speculative drafts);
- against the weights dequantized (float64 reference): within the activations' int8 rounding (per 256 inputs,
  as llama.cpp's q8_K, twice: the input and the experts' hidden; tests/engine/model/test_quant_linear.py states
  the per-output bound of one linear), asserted here as 2% of the output's norm, no value off by 5% of the largest;
- an expert id out of range is a clear error; MoeBlock takes the kernel for few rows and the loop for more;
- `python -m engine.bench.moe` times both paths over a GGUF file's decode steps and leaves the switch as it was.
Without AVX-512 VNNI the kernel's plain-C build computes the same integer sums (the loop there forced onto the row
kernel too).
"""

import sys
from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parents[1] / "loader"))
import kquants  # tests/engine/loader/kquants.py: K-quant blocks from the definition

from engine.bench import moe as moe_bench
from engine.loader.gguf_tensors import pack_blocks
from engine.model.kernels import build as kernels
from engine.model.native import moe
from engine.model.native.linear import Linear
from engine.model.native.moe import FUSED_ROWS, MoeBlock, QuantExperts, top_experts
from engine.model.native.quant import _fast

Q = gguf.GGMLQuantizationType
E, TOP_K, HIDDEN, INTER = 6, 2, 512, 256


def _weights(qtype, n: int, k: int, seed: int):
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).numpy()
    raw = kquants.quantize(w, qtype)
    return pack_blocks(raw, qtype, n, k)


def _experts(down_type=Q.Q6_K) -> QuantExperts:
    gate = [_weights(Q.Q4_K, INTER, HIDDEN, 10 + e) for e in range(E)]
    up = [_weights(Q.Q4_K, INTER, HIDDEN, 20 + e) for e in range(E)]
    down = [_weights(down_type, HIDDEN, INTER, 30 + e) for e in range(E)]
    ex = QuantExperts(gate, up, down)
    for lin in ex.linears():
        lin.small = True
    return ex


def _routing(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, HIDDEN, generator=g)
    weights, chosen = top_experts(torch.randn(rows, E, generator=g), TOP_K, True)
    return h, chosen, weights


def _loop(ex: QuantExperts, h, chosen, weights) -> torch.Tensor:
    """The per-expert loop (moe.py's path for many rows), each expert on the row kernel."""
    out = torch.zeros_like(h)
    for e in range(E):
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        if rows.numel():
            y = ex.down_lin[e]._linear(ex.gate_up[e]._integers(h[rows].contiguous(), "rows", None, "swiglu"), "rows")
            out.index_add_(0, rows, y.mul_(weights[rows, slot][:, None]))
    return out


def _dequantized(ex: QuantExperts, h, chosen, weights) -> torch.Tensor:
    out = torch.zeros(h.shape, dtype=torch.float64)
    for t in range(h.shape[0]):
        for j in range(TOP_K):
            e = int(chosen[t, j])
            gu = ex.gate_up[e].weight.dequantize().double()
            y = gu @ h[t].double()
            mid = F.silu(y[:INTER]) * y[INTER:]
            out[t] += float(weights[t, j]) * (ex.down_lin[e].weight.dequantize().double() @ mid)
    return out


@pytest.fixture(scope="module")
def experts() -> QuantExperts:
    assert kernels.load(), kernels.why_not()
    return _experts()


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_one_call_is_bitwise_the_per_expert_row_kernel_loop(experts, rows):
    h, chosen, weights = _routing(rows, seed=rows)
    got = experts.moe(h, chosen, weights)
    assert torch.equal(got, _loop(experts, h, chosen, weights))
    want = _dequantized(experts, h, chosen, weights)
    err = got.double() - want
    assert float(err.norm() / want.norm()) <= 0.02 and float(err.abs().max()) <= 0.05 * float(want.abs().max())


def test_each_row_is_bitwise_as_alone(experts):
    h, chosen, weights = _routing(FUSED_ROWS, seed=5)
    together = experts.moe(h, chosen, weights)
    for t in (0, 7, FUSED_ROWS - 1):
        alone = experts.moe(h[t:t + 1], chosen[t:t + 1], weights[t:t + 1])
        assert torch.equal(together[t:t + 1], alone)


def test_a_q4_k_down_projection_runs_too():
    ex = _experts(down_type=Q.Q4_K)
    h, chosen, weights = _routing(4, seed=6)
    assert torch.equal(ex.moe(h, chosen, weights), _loop(ex, h, chosen, weights))


def test_an_expert_id_out_of_range_is_a_clear_error(experts):
    h, chosen, weights = _routing(2, seed=7)
    chosen[1, 0] = E
    with pytest.raises(RuntimeError, match="expert id out of range"):
        experts.moe(h, chosen, weights)


def test_the_block_takes_the_kernel_for_few_rows_and_the_loop_for_more(experts):
    router = Linear([torch.randn(E, HIDDEN, generator=torch.Generator().manual_seed(8)) * 0.1])
    block = MoeBlock(router, experts, TOP_K, True)
    calls = []
    moe = experts.moe
    experts.moe = lambda *a: calls.append(a[0].shape[0]) or moe(*a)
    try:
        for rows in (1, FUSED_ROWS, FUSED_ROWS + 1):
            h = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
            weights, chosen = top_experts(router(h), TOP_K, True)
            residual = torch.randn(rows, HIDDEN)
            got = block(h, residual)
            torch.testing.assert_close(got, residual + _loop(experts, h, chosen, weights), atol=2e-3, rtol=0)
    finally:
        experts.moe = moe
    assert calls == ([1, FUSED_ROWS] if _fast()[0] else [])  # without VNNI the experts' linears take fp32 tiles


def test_the_bench_times_both_paths_over_a_gguf_file(tmp_path, capsys, monkeypatch):
    from moe_gguf import q4_k_m, write_moe_gguf
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False)
    write_moe_gguf(tmp_path / "m.gguf", Qwen3MoeForCausalLM(cfg).eval(), q4_k_m)
    monkeypatch.setenv("CELLSERVE_HOME", str(tmp_path / "home"))  # the converted folder, not the user's cache
    calls = []
    real = QuantExperts.moe
    QuantExperts.moe = lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a)
    try:
        moe_bench.main(["--gguf", str(tmp_path / "m.gguf"), "--sequences", "2", "--rounds", "1", "--steps", "2"])
    finally:
        QuantExperts.moe = real
    out = capsys.readouterr().out
    assert "2 sequences, 1 thread(s), one quant_moe call a layer: best" in out and "expert by expert: best" in out
    assert moe.FUSED_ROWS == FUSED_ROWS
    assert calls == ([2, 2, 2] if _fast()[0] else [])  # the fused path's 3 steps (one untimed), one layer

"""The int8-cell kernels (`rope_store_q8`, `cell_attention_q8` in csrc/cell_kernels.cpp) against a
dequantize-then-reference computation: the attention reads int8 rows in place with their scales and must
give what fp32 attention over the dequantized rows gives (fp32: to float rounding, 1e-5); the store must
write what `int8_kv.quantize` makes of the eagerly roped K and of V."""

import pytest
import torch
from transformers.models.llama.modeling_llama import rotate_half

from engine.cells import int8_kv
from engine.model.kernels import build as kernels


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.load(), f"the fused kernels did not build: {kernels.why_not()}"


TOL = {torch.float32: 1e-5, torch.bfloat16: 0.05}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])  # 24: not a multiple of the vector width
def test_rope_store_q8_writes_the_quantized_rows_and_returns_roped_q(dtype, head_dim):
    torch.manual_seed(1)
    n_tok, n_q, n_kv, n_cells = 5, 6, 2, 40
    qkv = torch.randn(n_tok, (n_q + 2 * n_kv) * head_dim, dtype=dtype)
    cos, sin = torch.randn(n_tok, head_dim, dtype=dtype), torch.randn(n_tok, head_dim, dtype=dtype)
    keys = torch.zeros(1, n_kv, n_cells, head_dim, dtype=torch.int8)
    values = torch.zeros_like(keys)
    k_scale, v_scale = torch.zeros(1, n_kv, n_cells), torch.zeros(1, n_kv, n_cells)
    cells = torch.tensor([3, 17, 4, 39, 0])
    q = torch.ops.cellserve.rope_store_q8(qkv, cos, sin, keys, values, k_scale, v_scale, cells, n_q, n_kv)
    heads = qkv.view(n_tok, -1, head_dim)
    roped = heads * cos[:, None] + rotate_half(heads) * sin[:, None]
    torch.testing.assert_close(q, roped[:, :n_q], atol=TOL[dtype], rtol=TOL[dtype])
    # V is copied, not computed: its rows are exactly int8_kv.quantize's
    vq, vs = int8_kv.quantize(heads[:, n_q + n_kv:].transpose(0, 1))
    assert torch.equal(values[0][:, cells], vq) and torch.equal(v_scale[0][:, cells], vs)
    # K is roped first (the kernel may fuse a multiply-add the eager ops round twice): same scale to
    # float rounding, each value within one step, dequantized within half a step of the eager rope
    kq, ks = int8_kv.quantize(roped[:, n_q:n_q + n_kv].transpose(0, 1))
    torch.testing.assert_close(k_scale[0][:, cells], ks, atol=0, rtol=TOL[dtype])
    assert (keys[0][:, cells].int() - kq.int()).abs().max() <= 1
    back = int8_kv.dequantize(keys[0][:, cells], k_scale[0][:, cells], torch.float32)
    err = (back - roped[:, n_q:n_q + n_kv].transpose(0, 1).float()).abs()
    assert (err <= ks[..., None] * 0.5 + TOL[dtype] * roped.float().abs().amax()).all()
    untouched = torch.ones(n_cells, dtype=torch.bool)
    untouched[cells] = False
    assert not keys[0][:, untouched].any() and not v_scale[0][:, untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n_q", "n_kv", "head_dim"), [(8, 4, 64), (9, 3, 64), (4, 4, 24)])
def test_cell_attention_q8_matches_attention_over_the_dequantized_rows(dtype, n_q, n_kv, head_dim):
    torch.manual_seed(2)
    n_tok, width, n_cells = 6, 37, 300
    q = torch.randn(n_tok, n_q, head_dim, dtype=dtype)
    keys, k_scale = int8_kv.quantize(torch.randn(1, n_kv, n_cells, head_dim) * 3)
    values, v_scale = int8_kv.quantize(torch.randn(1, n_kv, n_cells, head_dim))
    idx = torch.randint(0, n_cells, (n_tok, width))
    seen = torch.rand(n_tok, width) > 0.3
    seen[:, 0] = True  # a row always sees at least its own cell
    bias = torch.zeros(n_tok, width).masked_fill_(~seen, float("-inf"))
    out = torch.ops.cellserve.cell_attention_q8(q, keys, values, k_scale, v_scale, idx, bias, 0.125)
    k = int8_kv.dequantize(keys, k_scale, torch.float32)[0][:, idx]  # [Hkv, T, L, D]: the reference reads these
    v = int8_kv.dequantize(values, v_scale, torch.float32)[0][:, idx]
    group = n_q // n_kv
    qg = q.float().view(n_tok, n_kv, group, head_dim).transpose(0, 1)  # [Hkv, T, G, D]
    scores = torch.einsum("htgd,htld->htgl", qg, k) * 0.125 + bias[None, :, None]
    ref = torch.einsum("htgl,htld->htgd", scores.softmax(-1), v).transpose(0, 1).reshape(n_tok, -1)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype] / 5, rtol=TOL[dtype])


def test_int8_kernels_refuse_float_pools_and_bad_scales():
    q = torch.randn(2, 4, 16)
    pools = torch.zeros(1, 2, 8, 16, dtype=torch.int8)
    scales = torch.zeros(1, 2, 8)
    idx, bias = torch.tensor([[0, 1], [1, 2]]), torch.zeros(2, 2)
    with pytest.raises(RuntimeError, match="contiguous int8"):
        torch.ops.cellserve.cell_attention_q8(q, pools.float(), pools.float(), scales, scales, idx, bias, 1.0)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.cellserve.cell_attention_q8(q, pools, pools, scales[:, :, :4], scales, idx, bias, 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.cellserve.cell_attention_q8(q, pools, pools, scales, scales, torch.tensor([[0, 8], [1, 2]]), bias, 1.0)
    with pytest.raises(RuntimeError, match="scales must be"):
        torch.ops.cellserve.rope_store_q8(torch.randn(1, 8 * 16), torch.randn(1, 16), torch.randn(1, 16), pools, pools,
                                          scales.bfloat16(), scales, torch.tensor([0]), 4, 2)

"""The block-quantized linear kernels (engine/model/kernels/csrc/quant_linear.cpp, engine/model/native/quant.py)
against dequantize-then-`F.linear` in fp32, for each block kind.

Tolerances, and why:
- unpacking (`quant_dequant`, `QuantWeight.dequantize`): exact (equal to gguf-py's dequantize: both
  compute d * (q - z) + m in fp32 with the same roundings: for the K-quants (d * sc) * q - dmin * m, and
  (d * sc) * (q - 32) for q6_k; the C++ path is compiled without fused multiply-adds there).
- fp32 tiles (dequantized tiles + torch.mm; without VNNI, or past the row kernel's rows with the GEMM
  off): fp32 summation order only: atol 1e-4 on outputs of size ~10.
- many rows on bf16 tiles (`BF16_ROWS` rows and more on CPUs with AVX512-BF16): the tile is the exact
  dequantized weight rounded to bf16 (checked exactly); x is rounded to bf16 and torch's bf16 matmul
  sums in fp32 and rounds the output to bf16, so against the fp32 reference an output moves by at most
  (|x| @ |W|.T) * 2^-8 (two roundings of relative 2^-9) + |y| * 2^-8 (the output's) + 1e-4.
- the integer kernels (`quant_linear`, the row kernel: few rows, up to INVARIANT_ROWS in a step with drafts,
  each bitwise as alone: tests/engine/model/test_quant_rows_invariant.py; `quant_gemm`, the blocked GEMM for
  more): the activations are rounded to int8 (scale da = amax / 127, half away from
  zero) per 32-block for the 32-weight kinds (llama.cpp's q8_0) and per 256-weight super-block for the
  K-quants (llama.cpp's q8_K: the row kernel then sums each super-block in integers), so against the
  fp32 reference an output may move by at most sum_k |w_k| * da_s(k) / 2 with da_s(k) the scale of
  input k's block or super-block (each activation moves by at most da / 2); the tests assert that
  bound (+1e-4). The K-quants' coarser scale makes that bound up to ~8x looser there. Against a reference that rounds the activations the same way and sums in float64 both
  kernels are exact up to fp32 summation (both round the K-quants per 256, and both builds, with and
  without VNNI, compute the same integers): atol 2e-4 (outputs of size ~10, K up to 2,048; scaled by
  1 + max |y| where the test scales x up); so they agree with each other within that too (the same
  integers, summed in fp32 in a different order).
"""

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants

sys.path.insert(0, str(Path(__file__).parents[1] / "loader"))
import kquants  # tests/engine/loader/kquants.py: K-quant blocks from the definition

from engine.loader.gguf_tensors import KIND_IDS, QuantWeight, pack_blocks
from engine.model.kernels import build as kernels
from engine.model.native.quant import BF16_ROWS, QuantEmbedding, QuantLinear
from engine.model.native.rows import INVARIANT_ROWS, drafted_step

Q = gguf.GGMLQuantizationType
KINDS = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q4_k": Q.Q4_K,
         "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
K_KINDS = {"q4_k", "q5_k", "q6_k"}
FILE_BYTES = {"q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32, "q4_k": 144 / 256,
              "q5_k": 176 / 256, "q6_k": 210 / 256}
KEPT_BYTES = {**FILE_BYTES, "q4_k": 148 / 256, "q5_k": 180 / 256}  # the K-quants' 12 scale bytes kept as 16


def _k(kind: str, k: int) -> int:
    """K-quants come in 256-weight super-blocks: the 32-block sizes scaled up."""
    return k * 8 if kind in K_KINDS else k


def _weight(kind: str, n: int, k: int, seed: int = 0) -> tuple[QuantWeight, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.1 + 0.02).numpy()
    if seed % 2:  # a row of zeros and a sub-block of zeros: zero scales must give zeros, not NaNs
        w[1] = 0
        w[2, 32:64] = 0
    raw = (kquants.quantize if kind in K_KINDS else quants.quantize)(w, KINDS[kind])
    ref = torch.from_numpy(quants.dequantize(raw, KINDS[kind]).reshape(n, k).copy())
    return pack_blocks(raw, KINDS[kind], n, k), ref


def _round_activations(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded as the integer kernels do (int8 per 32-block; the K-quants per 256-weight super-block,
    llama.cpp's q8_K), and each value's scale da."""
    b = x.reshape(x.shape[0], -1, 256 if kind in K_KINDS else 32)
    da = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(da == 0, torch.zeros_like(da), 1 / da)
    v = b * inv
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return (q * da).reshape(x.shape), da.expand_as(b).reshape(x.shape)


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.load(), kernels.why_not()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("k", [96, 128])  # 96: two pairs of blocks... and a lone block at the end
def test_unpacking_is_exact(kind, k):
    k = _k(kind, k)
    w, ref = _weight(kind, 37, k, seed=1)
    # the file's own bytes (K-quants: + 4 bytes a super-block; q5_0 / q5_1: fifth bits to whole pairs, + 4 bytes
    # a row where K ends in a lone block)
    lone = 4 * 37 if kind in ("q5_0", "q5_1") and k % 64 else 0
    assert w.nbytes == KEPT_BYTES[kind] * 37 * k + lone
    torch.testing.assert_close(w.dequantize(), ref, atol=0, rtol=0)
    torch.testing.assert_close(w.dequantize(5, 30), ref[5:30], atol=0, rtol=0)
    torch.testing.assert_close(torch.ops.cellserve.quant_dequant(w.tensors(), KIND_IDS[kind], 3, 37), ref[3:],
                               atol=0, rtol=0)
    torch.testing.assert_close(torch.ops.cellserve.quant_dequant_bf16(w.tensors(), KIND_IDS[kind], 3, 37),
                               ref[3:].bfloat16(), atol=0, rtol=0)
    idx = torch.tensor([4, 0, 36, 4])
    torch.testing.assert_close(QuantEmbedding(w)(idx), ref[idx], atol=0, rtol=0)


@pytest.mark.parametrize("ggml_type", [Q.Q5_0, Q.Q5_1])
def test_q5_blocks_keep_the_file_bytes(ggml_type):
    """Q5_0 (most of a Gemma 3 Q4_K_M file) and Q5_1 are kept as their own kinds at the file's 0.6875 / 0.75 bytes
    a weight (not widened to q8_0's 1.0625), in quant_tiles' tiles where K is whole pairs: gguf-py's weights."""
    n, k = 40, 128
    g = torch.Generator().manual_seed(ggml_type)
    w = (torch.randn(n, k, generator=g) * 0.1 + 0.02).numpy()
    raw = quants.quantize(w, ggml_type)
    ref = torch.from_numpy(quants.dequantize(raw, ggml_type).reshape(n, k).copy())
    q = pack_blocks(raw, ggml_type, n, k)
    assert q.kind == ggml_type.name.lower() and q.nbytes == raw.nbytes
    lin = QuantLinear(q)
    assert lin.tiled and lin.weight.nbytes - lin.weight.padding == raw.nbytes  # (+ the last tile's zero rows)
    torch.testing.assert_close(lin.weight.dequantize(), ref, atol=0, rtol=0)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("k", [96, 160, 256])
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 8])
def test_small_rows_kernel(kind, k, rows):
    n = 70
    k = _k(kind, k)
    w, ref = _weight(kind, n, k, seed=k + 1)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    x[0, :32] = 0  # an all-zero activation block (scale 0)
    bias, other = torch.randn(n, generator=g), torch.randn(rows, n, generator=g)
    lin = QuantLinear(w, bias)
    lin.small = True
    assert lin.is_small(x) == torch.ops.cellserve.quant_linear_fast()
    y = torch.ops.cellserve.quant_linear(x, w.tensors(), KIND_IDS[kind], bias, None, "none")
    xr, da = _round_activations(x, kind)
    exact = (xr.double() @ ref.double().T + bias.double()).float()
    torch.testing.assert_close(y, exact, atol=2e-4, rtol=0)
    bound = (da / 2) @ ref.abs().T + 1e-4
    assert ((y - F.linear(x, ref, bias)).abs() <= bound).all()
    torch.testing.assert_close(torch.ops.cellserve.quant_linear(x, w.tensors(), KIND_IDS[kind], bias, other, "add"),
                               exact + other, atol=2e-4, rtol=0)
    gu = torch.ops.cellserve.quant_linear(x, w.tensors(), KIND_IDS[kind], bias, None, "swiglu")
    torch.testing.assert_close(gu, F.silu(exact[:, : n // 2]) * exact[:, n // 2:], atol=2e-4, rtol=0)
    # QuantLinear: in integers with VNNI (the row kernel, or quant_gemm past its rows), else on fp32 tiles (no rounding)
    want = exact if lin.is_small(x) else F.linear(x, ref, bias)
    torch.testing.assert_close(lin.plus(x, other), want + other, atol=2e-4, rtol=0)
    torch.testing.assert_close(lin.swiglu(x), F.silu(want[:, : n // 2]) * want[:, n // 2:], atol=2e-4, rtol=0)


def rounded_case(kind: str, ref: torch.Tensor, rows: int):
    """(x, bias, other, exact, da): `rows` rows of x at several scales (one all-zero activation block), a bias
    and `other` for the weight `ref` [n, k], the float64 result over x rounded as the integer kernels round it
    (`_round_activations`), and each input's scale da."""
    n, k = ref.shape
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g) * (1 + torch.rand(rows, 1, generator=g) * 4)
    x[0, 32:64] = 0  # an all-zero activation block (scale 0)
    bias, other = torch.randn(n, generator=g), torch.randn(rows, n, generator=g)
    xr, da = _round_activations(x, kind)
    return x, bias, other, (xr.double() @ ref.double().T + bias.double()).float(), da


# 32-weight kinds: 1,056 inputs = 33 blocks, so 17 pairs, the last one half, over 3 of the GEMM's
# 512-input blocks; K-quants: 768 and 1,280 (2 and 3 of them)
GEMM_K = {kind: [96, 1056] if kind not in K_KINDS else [768, 1280] for kind in KINDS}


@pytest.mark.parametrize("kind,k", [(kind, k) for kind in KINDS for k in GEMM_K[kind]])
def test_many_rows_gemm(kind, k):
    """quant_gemm at row counts around its 6-row register tiles, 70 outputs (two 32-row tasks and a
    partial one; swiglu: 35 = 16 + 16 + 3), every op, against the rounded-activation reference and
    the bound; and equal to the row kernel within float summation."""
    n = 70
    w, ref = _weight(kind, n, k, seed=k + 2)
    tensors, kid = w.tensors(), KIND_IDS[kind]
    for rows in (1, 3, 9, 37):
        x, bias, other, exact, da = rounded_case(kind, ref, rows)
        y = torch.ops.cellserve.quant_gemm(x, tensors, kid, bias, None, "none")
        torch.testing.assert_close(y, exact, atol=2e-4 * (1 + exact.abs().max()), rtol=0)
        assert ((y - F.linear(x, ref, bias)).abs() <= (da / 2) @ ref.abs().T + 1e-4).all()
        torch.testing.assert_close(y, torch.ops.cellserve.quant_linear(x, tensors, kid, bias, None, "none"),
                                   atol=2e-4 * (1 + exact.abs().max()), rtol=0)
        added = torch.ops.cellserve.quant_gemm(x, tensors, kid, bias, other, "add")
        torch.testing.assert_close(added, exact + other, atol=2e-4 * (1 + exact.abs().max()), rtol=0)
        gu = torch.ops.cellserve.quant_gemm(x, tensors, kid, bias, None, "swiglu")
        want = F.silu(exact[:, : n // 2]) * exact[:, n // 2:]
        torch.testing.assert_close(gu, want, atol=2e-4 * (1 + want.abs().max()), rtol=0)


@pytest.mark.parametrize("kind", list(KINDS))
def test_quant_linear_many_rows_in_integers(kind):
    """QuantLinear with the kernels: the 32-weight kinds on quant_tiles at every row count; the K-quants on the
    row kernel up to 8 rows (in a step with drafts up to INVARIANT_ROWS), more on the GEMM; every verb."""
    n, k = 90, _k(kind, 160)
    w, ref = _weight(kind, n, k, seed=5)
    lin = QuantLinear(w, torch.randn(n))
    lin.small = True
    if not torch.ops.cellserve.quant_linear_fast():
        pytest.skip("the integer kernels run only with AVX-512 VNNI")
    for rows in (2, 3, INVARIANT_ROWS, INVARIANT_ROWS + 1, 33):
        g = torch.Generator().manual_seed(rows)
        x, other = torch.randn(rows, k, generator=g), torch.randn(rows, n, generator=g)
        # the 32-weight kinds: quant_tiles at every row count (row-invariant everywhere)
        assert lin.path(x) == ("tiles" if lin.tiled else "rows" if rows <= lin.row_rows else "gemm")
        with drafted_step(True):
            assert lin.path(x) == ("tiles" if lin.tiled else "rows" if rows <= INVARIANT_ROWS else "gemm")
        xr, _ = _round_activations(x, kind)
        want = (xr.double() @ ref.double().T + lin.bias.double()).float()
        torch.testing.assert_close(lin(x), want, atol=2e-4, rtol=0)
        torch.testing.assert_close(lin.plus(x, other), want + other, atol=2e-4, rtol=0)
        torch.testing.assert_close(lin.silu(x), F.silu(want), atol=2e-4, rtol=0)
        torch.testing.assert_close(lin.times(x, other), want * other, atol=2e-4, rtol=0)
        torch.testing.assert_close(lin.swiglu(x), F.silu(want[:, :45]) * want[:, 45:], atol=2e-4, rtol=0)


@pytest.mark.parametrize("small", [True, False], ids=["kernels", "eager"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_many_rows_tiles(kind, small):
    n, k = 90, _k(kind, 160)
    w, ref = _weight(kind, n, k, seed=3)
    g = torch.Generator().manual_seed(1)
    rows = INVARIANT_ROWS + 1  # fewer run on the row kernel with the GEMM off too (row invariance)
    x, other = torch.randn(rows, k, generator=g), torch.randn(rows, n, generator=g)
    bias = torch.randn(n, generator=g)
    lin = QuantLinear(w, bias)
    lin.small = small
    lin.gemm = False  # the fp32-tile path (the GEMM's A/B baseline; the path without VNNI)
    lin.tile = 16  # six tiles, the last one partial: the whole fp32 matrix is never built
    assert not lin.is_small(x)
    want = F.linear(x, ref, bias)
    torch.testing.assert_close(lin(x), want, atol=1e-4, rtol=0)
    torch.testing.assert_close(lin.plus(x, other), want + other, atol=1e-4, rtol=0)
    torch.testing.assert_close(lin.silu(x), F.silu(want), atol=1e-4, rtol=0)
    torch.testing.assert_close(lin.times(x, other), want * other, atol=1e-4, rtol=0)
    torch.testing.assert_close(lin.swiglu(x), F.silu(want[:, :45]) * want[:, 45:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", sorted(K_KINDS))
def test_the_test_quantizer_writes_what_gguf_py_reads(kind):
    """tests/engine/loader/kquants.py's blocks, read back by gguf-py, are the weights within their steps."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(8, 512, generator=g) * 0.1).numpy()
    back = quants.dequantize(kquants.quantize(w, KINDS[kind]), KINDS[kind]).reshape(w.shape)
    step = {"q4_k": 15, "q5_k": 31, "q6_k": 63}[kind]
    # a 32-block's range over the step count, + the 6-bit scale codes' relative error (1 / 63)
    bound = np.ptp(w.reshape(8, -1, 32), axis=-1).max() / step * (0.5 + 1.0)
    assert abs(back - w).max() < bound


@pytest.mark.parametrize("kind", list(KINDS))
def test_many_rows_bf16_tiles(kind):
    """BF16_ROWS rows and more on a CPU with native bf16 matmuls: bf16 tiles (two of them), every verb,
    within the bf16 rounding bound of the fp32 reference."""
    if not torch.ops.cellserve.quant_bf16_fast():
        pytest.skip("bf16 tiles are taken only on CPUs with AVX512-BF16")
    n, k = 90, _k(kind, 160)
    w, ref = _weight(kind, n, k, seed=7)
    g = torch.Generator().manual_seed(2)
    rows = BF16_ROWS + 3
    x, other, bias = torch.randn(rows, k, generator=g), torch.randn(rows, n, generator=g), torch.randn(n, generator=g)
    lin = QuantLinear(w, bias)
    lin.small = True
    lin.tile = 32  # bf16 tiles of 64 rows: two, the last one partial
    assert not lin.tiled and lin.path(x) == "bf16" and lin.path(x[:BF16_ROWS - 1]) != "bf16"
    want = F.linear(x, ref, bias)
    bound = (x.abs() @ ref.abs().T) * 2**-8 + want.abs() * 2**-8 + 1e-4
    y = lin(x)
    assert ((y - want).abs() <= bound).all()
    assert ((lin.plus(x, other) - want - other).abs() <= bound + 1e-5).all()
    gu, wgu = lin.swiglu(x), F.silu(want[:, :45]) * want[:, 45:]
    torch.testing.assert_close(gu, F.silu(y[:, :45]) * y[:, 45:], atol=0, rtol=0)
    assert (gu - wgu).abs().max() < 0.05 * (1 + wgu.abs().max())

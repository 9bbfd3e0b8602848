"""quant_tiles (engine/model/kernels/csrc/quant_tiles.cpp) and `TiledWeight` (engine/model/native/quant_tiles.py):
the 32-weight kinds kept in 16-row tiles.

- Tiling is lossless: untiled rows, looked-up rows and the dequantized weight equal the row layout's (gguf-py's
  dequantize) bit for bit, for any N (a partial last tile) and a [gate; up] weight tiled in halves; only
  weights of whole pairs (K % 64 == 0) are tiled.
- The kernel against a reference that rounds the activations as it does (int8 per 32-block) and sums in
  float64: atol 2e-4 scaled by the outputs (as tests/engine/model/test_quant_linear.py states for the other
  integer kernels), every op.
- Row invariance at every row count, not only up to INVARIANT_ROWS: each row bitwise as a call with it alone.
- Bad arguments: a clear error, no output.
"""

import pytest
import torch
import torch.nn.functional as F
from test_quant_linear import (  # puts tests/engine/loader on sys.path
    _round_activations,
    _weight,
    rounded_case,
)

from engine.loader.gguf_tensors import KIND_IDS
from engine.model.kernels import build as kernels
from engine.model.native.quant import BF16_ROWS, TILED_BF16_ROWS, QuantLinear
from engine.model.native.quant_tiles import TILED_KINDS, TiledWeight, tileable


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.load(), kernels.why_not()


def _vnni() -> None:
    if not torch.ops.cellserve.quant_linear_fast():
        pytest.skip("quant_tiles runs only with AVX-512 VNNI (QuantLinear untiles to fp32 tiles without it)")


@pytest.mark.parametrize("kind", TILED_KINDS)
@pytest.mark.parametrize("n,k", [(37, 128), (64, 64), (70, 1024)])
def test_tiling_is_lossless(kind, n, k):
    w, ref = _weight(kind, n, k, seed=n)
    t = TiledWeight.of(w)
    assert t.shape == (n, k) and t.qs.shape[0] == -(-n // 16)
    torch.testing.assert_close(t.dequantize(), ref, atol=0, rtol=0)
    torch.testing.assert_close(t.dequantize(5, 30), ref[5:30], atol=0, rtol=0)
    idx = torch.tensor([n - 1, 0, 17, 17, 3])
    torch.testing.assert_close(t.dequantize(index=idx), ref[idx], atol=0, rtol=0)
    back = t.untile()
    assert all(torch.equal(a, b) for a, b in zip(back.fields(), w.fields()) if a is not None)
    # the row layout's bytes + the zero rows of the last partial tile
    assert t.nbytes == w.nbytes * 16 * -(-n // 16) // n and t.nbytes - t.padding == w.nbytes
    assert not tileable(_weight(kind, 16, 96)[0])  # an odd block count stays in the row layout
    if n % 2 == 0:
        halves = TiledWeight.of(w, parts=2)
        torch.testing.assert_close(halves.dequantize(), ref, atol=0, rtol=0)
        torch.testing.assert_close(halves.dequantize(index=idx), ref[idx], atol=0, rtol=0)


def _call(t: TiledWeight, x, bias=None, other=None, op="none"):
    return torch.ops.cellserve.quant_tiles(x, t.tensors(), KIND_IDS[t.kind], t.n, t.parts, bias, other, op)


@pytest.mark.parametrize("kind", TILED_KINDS)
@pytest.mark.parametrize("k", [64, 1024])
def test_against_rounded_reference(kind, k):
    _vnni()
    n = 70  # 5 tiles, the last one of 6 rows; swiglu halves of 35: 3 tiles each
    w, ref = _weight(kind, n, k, seed=k)
    t, halves = TiledWeight.of(w), TiledWeight.of(w, parts=2)
    for rows in (1, 3, 9, 37):
        x, bias, other, exact, da = rounded_case(kind, ref, rows)
        tol = 2e-4 * (1 + exact.abs().max())
        y = _call(t, x, bias)
        torch.testing.assert_close(y, exact, atol=tol, rtol=0)
        assert ((y - F.linear(x, ref, bias)).abs() <= (da / 2) @ ref.abs().T + 1e-4).all()
        torch.testing.assert_close(_call(t, x, bias, other, "add"), exact + other, atol=tol, rtol=0)
        torch.testing.assert_close(_call(halves, x, bias), exact, atol=tol, rtol=0)
        want = F.silu(exact[:, :35]) * exact[:, 35:]
        torch.testing.assert_close(_call(halves, x, bias, op="swiglu"), want, atol=2e-4 * (1 + want.abs().max()),
                                   rtol=0)


@pytest.mark.parametrize("kind", TILED_KINDS)
@pytest.mark.parametrize("op", ["none", "add", "swiglu"])
def test_every_row_as_alone(kind, op):
    """Rows 1 to 40 (past INVARIANT_ROWS, over several 6-row register tiles): each row bitwise as alone."""
    _vnni()
    n, k, rows = 64, 1024, 40  # swiglu: 32-row halves are whole tiles, so parts = 1 serves it too
    w, _ = _weight(kind, n, k, seed=9)
    t = TiledWeight.of(w, parts=2 if op == "swiglu" else 1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, k, generator=g) * (0.1 + torch.rand(rows, 1, generator=g) * 8)
    bias = torch.randn(n, generator=g)
    other = torch.randn(rows, n // 2 if op == "swiglu" else n, generator=g) if op == "add" else None

    def run(a, o):
        return _call(t, a, bias, o, op)

    alone = torch.cat([run(x[i:i + 1].clone(), None if other is None else other[i:i + 1].clone())
                       for i in range(rows)])
    for m in (2, 4, 5, 9, 16, 17, 33, 40):
        assert torch.equal(run(x[:m].contiguous(), None if other is None else other[:m].contiguous()), alone[:m])
    if op == "swiglu":
        assert torch.equal(_call(TiledWeight.of(w), x, bias, op="swiglu"), alone)


def test_quant_linear_keeps_tiles_and_untiles_for_dequantizing_paths():
    """QuantLinear tiles the 32-weight kinds (one copy) and the fp32 tile path reads those rows untiled (the bf16
    one straight from the tiles: test_bf16_rows_straight_from_the_tiles_are_the_untiled_rows);
    a [gate; up] weight of odd halves (not whole tiles) still gives swiglu."""
    w, ref = _weight("q4_1", 70, 192, seed=4)
    lin = QuantLinear(w, parts=2)
    assert isinstance(lin.weight, TiledWeight) and lin.weight.parts == 2 and lin.nbytes == lin.weight.nbytes
    x = torch.randn(5, 192)
    lin.small, lin.gemm, lin.tile = False, False, 16
    torch.testing.assert_close(lin(x), F.linear(x, ref), atol=1e-4, rtol=0)
    odd = QuantLinear(w)  # parts 1, halves of 35 rows: computed whole, then silu * up
    want = F.linear(x, ref)
    torch.testing.assert_close(odd.swiglu(x), F.silu(want[:, :35]) * want[:, 35:], atol=1e-4, rtol=0)


def test_tiled_weights_switch_to_bf16_tiles_at_their_own_crossover():
    """A bf16 step dequantizes the whole weight first, which quant_tiles never pays: tiled weights switch to bf16
    tiles only from TILED_BF16_ROWS rows (row-layout weights from BF16_ROWS), and agree with the reference on
    both sides of it."""
    if not torch.ops.cellserve.quant_bf16_fast():
        pytest.skip("bf16 tiles are taken only on CPUs with AVX512-BF16")
    w, ref = _weight("q4_1", 48, 128, seed=9)
    lin = QuantLinear(w)
    lin.small = True
    assert lin.tiled and lin.bf16_rows == TILED_BF16_ROWS != BF16_ROWS
    x = torch.randn(TILED_BF16_ROWS, 128, generator=torch.Generator().manual_seed(3))
    below = x[: TILED_BF16_ROWS - 1]
    assert lin.path(below) == "tiles" and lin.path(x) == "bf16"
    xr, _ = _round_activations(below, "q4_1")  # tiles: int8 activations, exact sums
    torch.testing.assert_close(lin(below), (xr.double() @ ref.double().T).float(), atol=2e-4, rtol=0)
    want = F.linear(x, ref)
    bound = (x.abs() @ ref.abs().T) * 2**-8 + want.abs() * 2**-8 + 1e-4  # bf16 tiles: x, W and y rounded
    assert ((lin(x) - want).abs() <= bound).all()


def test_bad_arguments_say_what_is_wrong():
    _vnni()
    w, _ = _weight("q4_1", 32, 128)
    t = TiledWeight.of(w)
    x = torch.randn(2, 128)
    with pytest.raises(RuntimeError, match="kind must be"):
        torch.ops.cellserve.quant_tiles(x, t.tensors(), 3, 32, 1, None, None, "none")
    with pytest.raises(RuntimeError, match="qs must be"):
        torch.ops.cellserve.quant_tiles(x, t.tensors(), KIND_IDS["q8_0"], 32, 1, None, None, "none")
    with pytest.raises(RuntimeError, match="x must be"):
        _call(t, torch.randn(2, 64))
    with pytest.raises(RuntimeError, match="op must be"):
        _call(t, x, op="gelu")
    with pytest.raises(RuntimeError, match="swiglu needs"):
        torch.ops.cellserve.quant_tiles(x, t.tensors(), KIND_IDS["q4_1"], 30, 1, None, None, "swiglu")


@pytest.mark.parametrize("kind", ["q4_1", "q5_1"])  # q5_1: the fifth bits' masks too
@pytest.mark.parametrize("parts", [1, 2])
def test_untile_any_range(kind, parts):
    """Ranges starting and ending inside tiles, across the [gate; up] halves, empty: the row layout's rows."""
    w, _ = _weight(kind, 70, 128, seed=6)
    t = TiledWeight.of(w, parts=parts)
    for r0, r1 in [(0, 70), (3, 30), (17, 35), (30, 41), (35, 36), (69, 70), (20, 20)]:
        got = t.untile(r0, r1)
        assert got.shape == (r1 - r0, 128)
        assert all(torch.equal(a, b[r0:r1]) for a, b in zip(got.fields(), w.fields()) if a is not None)
        assert all(a.is_contiguous() for a in got.fields() if a is not None)


@pytest.mark.parametrize("kind", TILED_KINDS)
@pytest.mark.parametrize("parts", [1, 2])
def test_bf16_rows_straight_from_the_tiles_are_the_untiled_rows(kind, parts):
    """The bf16 path of prefill reads rows straight from the tiles (`quant_tiles_bf16`): bitwise what untiling
    them and `quant_dequant_bf16` give, for ranges inside tiles, across the [gate; up] halves and empty."""
    if not torch.ops.cellserve.quant_bf16_fast():
        pytest.skip("quant_tiles_bf16 needs AVX-512 VNNI and AVX512-BF16")
    w, _ = _weight(kind, 70, 256, seed=9)
    t = TiledWeight.of(w, parts=parts)
    for r0, r1 in [(0, 70), (3, 30), (17, 35), (30, 41), (69, 70)]:
        got = torch.ops.cellserve.quant_tiles_bf16(t.tensors(), KIND_IDS[kind], 70, parts, r0, r1)
        want = torch.ops.cellserve.quant_dequant_bf16(t.untile(r0, r1).tensors(), KIND_IDS[kind], 0, r1 - r0)
        assert got.dtype == torch.bfloat16 and got.shape == (r1 - r0, 256) and torch.equal(got, want)
    assert torch.ops.cellserve.quant_tiles_bf16(t.tensors(), KIND_IDS[kind], 70, parts, 20, 20).shape == (0, 256)
    with pytest.raises(RuntimeError, match="rows out of range"):
        torch.ops.cellserve.quant_tiles_bf16(t.tensors(), KIND_IDS[kind], 70, parts, 10, 71)

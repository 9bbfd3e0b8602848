"""The fused CPU kernels (engine/model/kernels/csrc/*.cpp) against the eager ops they replace.

fp32 must agree to float rounding; bf16 rounds once where the eager ops round several times, so it
is held to bf16's own resolution. The build's fallback (no kernels: eager ops) is checked too.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half

from engine.model.kernels import build as kernels


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.load(), f"the fused kernels did not build: {kernels.why_not()}"


TOL = {torch.float32: 1e-5, torch.bfloat16: 0.05}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    torch.manual_seed(0)
    x, w = torch.randn(7, 72, dtype=dtype), torch.randn(72, dtype=dtype)
    xf = x.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)  # LlamaRMSNorm
    torch.testing.assert_close(torch.ops.cellserve.rms_norm(x, w, 1e-6), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])  # 24: not a multiple of the vector width
def test_rope_store_ropes_q_and_k_and_writes_the_pools(dtype, head_dim):
    torch.manual_seed(1)
    n_tok, n_q, n_kv, n_cells = 5, 6, 2, 40
    qkv = torch.randn(n_tok, (n_q + 2 * n_kv) * head_dim, dtype=dtype)
    cos, sin = torch.randn(n_tok, head_dim, dtype=dtype), torch.randn(n_tok, head_dim, dtype=dtype)
    keys = torch.zeros(1, n_kv, n_cells, head_dim, dtype=dtype)
    values = torch.zeros_like(keys)
    cells = torch.tensor([3, 17, 4, 39, 0])
    q = torch.ops.cellserve.rope_store(qkv, cos, sin, keys, values, cells, n_q, n_kv)
    heads = qkv.view(n_tok, -1, head_dim)
    roped = heads * cos[:, None] + rotate_half(heads) * sin[:, None]
    tol = {"atol": TOL[dtype], "rtol": TOL[dtype]}
    torch.testing.assert_close(q, roped[:, :n_q], **tol)
    torch.testing.assert_close(keys[0][:, cells].transpose(0, 1), roped[:, n_q:n_q + n_kv], **tol)
    torch.testing.assert_close(values[0][:, cells].transpose(0, 1), heads[:, n_q + n_kv:])
    untouched = torch.ones(n_cells, dtype=torch.bool)
    untouched[cells] = False
    assert not keys[0][:, untouched].any() and not values[0][:, untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n_q", "n_kv", "head_dim"), [(8, 4, 64), (9, 3, 64), (4, 2, 128), (4, 4, 24)])
def test_cell_attention_matches_masked_softmax_attention(dtype, n_q, n_kv, head_dim):
    torch.manual_seed(2)
    n_tok, width, n_cells = 6, 37, 300
    q = torch.randn(n_tok, n_q, head_dim, dtype=dtype)
    keys, values = torch.randn(1, n_kv, n_cells, head_dim, dtype=dtype), torch.randn(1, n_kv, n_cells, head_dim, dtype=dtype)
    idx = torch.randint(0, n_cells, (n_tok, width))
    seen = torch.rand(n_tok, width) > 0.3
    seen[:, 0] = True  # a row always sees at least its own cell
    bias = torch.zeros(n_tok, width).masked_fill_(~seen, float("-inf"))
    out = torch.ops.cellserve.cell_attention(q, keys, values, idx, bias, 0.125)
    k, v = keys[0][:, idx].float(), values[0][:, idx].float()  # [Hkv, T, L, D]
    group = n_q // n_kv
    qg = q.float().view(n_tok, n_kv, group, head_dim).transpose(0, 1)  # [Hkv, T, G, D]
    scores = torch.einsum("htgd,htld->htgl", qg, k) * 0.125 + bias[None, :, None]
    ref = torch.einsum("htgl,htld->htgd", scores.softmax(-1), v).transpose(0, 1).reshape(n_tok, -1)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype] / 5, rtol=TOL[dtype])
    if dtype == torch.float32:  # and the same as torch's own sdpa, row by row
        for t in range(n_tok):
            cols = idx[t][seen[t]]
            o = F.scaled_dot_product_attention(q[t:t + 1].transpose(0, 1)[None], keys[:, :, cols], values[:, :, cols],
                                               scale=0.125, enable_gqa=True)
            torch.testing.assert_close(out[t], o[0].transpose(0, 1).reshape(-1), atol=1e-5, rtol=1e-5)


def _attend(q, pools, idx, bias):
    if pools[0].dtype == torch.int8:
        return torch.ops.cellserve.cell_attention_q8(q, pools[0], pools[1], pools[2], pools[3], idx, bias, 0.125)
    return torch.ops.cellserve.cell_attention(q, pools[0], pools[1], idx, bias, 0.125)


@pytest.mark.parametrize("pool", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_rows_sharing_cells_are_each_the_row_alone_bitwise(pool, head_dim):
    """A verification step gives a sequence's rows (its last token, its drafts) the cells of its last row, each
    row masked to what it sees: the kernel reads each block once for all of them (cell_blocks.h). Every row must
    still come out bit for bit as in a call of its own over just its cells, as a lone decode step computes it,
    whatever the call's width and the other rows (another sequence's, a lone row's)."""
    from engine.cells import int8_kv

    torch.manual_seed(5)
    n_q, n_kv, n_cells, dtype = 9, 3, 400, torch.bfloat16 if pool == "bfloat16" else torch.float32
    k, v = torch.randn(1, n_kv, n_cells, head_dim) * 2, torch.randn(1, n_kv, n_cells, head_dim)
    pools = ((*int8_kv.quantize(k), *int8_kv.quantize(v)) if pool == "int8" else (k.to(dtype), v.to(dtype)))
    if pool == "int8":
        pools = (pools[0], pools[2], pools[1], pools[3])  # keys, values, key scales, value scales
    # sequence A: 45 cached cells + 8 drafted (9 rows, 45..53 cells seen); B: 20 + 3 (4 rows); C: one decode row
    cells = torch.randperm(n_cells)
    rows = [(cells[:53], 45 + r) for r in range(9)] + [(cells[60:83], 20 + r) for r in range(4)] + [(cells[90:120], 30)]
    width = 61  # wider than any row: padding past every row's own cells
    idx, bias = torch.zeros(len(rows), width, dtype=torch.int64), torch.full((len(rows), width), float("-inf"))
    for t, (seq_cells, seen) in enumerate(rows):
        idx[t, : len(seq_cells)] = seq_cells
        bias[t, :seen] = 0.0
    bias[3, 7] = float("-inf")  # a hole inside a drafted row's view (a window, a dropped cell)
    q = torch.randn(len(rows), n_q, head_dim).to(dtype)
    out = _attend(q, pools, idx, bias)
    for t, (seq_cells, seen) in enumerate(rows):
        alone = _attend(q[t : t + 1].contiguous(), pools, idx[t : t + 1, :seen].contiguous(), bias[t : t + 1, :seen].contiguous())
        assert torch.equal(out[t : t + 1], alone), t


def test_bad_inputs_are_refused_with_a_reason():
    q = torch.randn(2, 4, 16)
    pools = torch.zeros(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.cellserve.cell_attention(q, pools, pools, torch.tensor([[0, 8], [1, 2]]), torch.zeros(2, 2), 1.0)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        torch.ops.cellserve.rms_norm(torch.randn(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.cellserve.rope_store(torch.randn(1, 8 * 16), torch.randn(1, 16, dtype=torch.bfloat16),
                                       torch.randn(1, 16, dtype=torch.bfloat16), pools, pools, torch.tensor([0]), 4, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("k", [64, 72])  # 72: the scalar tail after the vector loop
def test_small_linear_matches_linear(dtype, rows, k):
    torch.manual_seed(0)
    small = torch.ops.cellserve.small_linear
    x = torch.randn(rows, k, dtype=dtype)
    q, kk, v = (torch.randn(n, k, dtype=dtype) * 0.2 for n in (48, 16, 16))
    bias = torch.randn(80, dtype=dtype)
    ref = F.linear(x.float(), torch.cat([q, kk, v]).float(), bias.float())
    tol = {"atol": TOL[dtype], "rtol": TOL[dtype]}
    torch.testing.assert_close(small(x, [q, kk, v], bias, None, "none").float(), ref, **tol)
    torch.testing.assert_close(small(x, [q], None, None, "none").float(), x.float() @ q.float().T, **tol)
    other = torch.randn(rows, 48, dtype=dtype)
    torch.testing.assert_close(small(x, [q], None, other, "add").float(), other.float() + x.float() @ q.float().T, **tol)
    gate, up = torch.randn(40, k, dtype=dtype) * 0.2, torch.randn(40, k, dtype=dtype) * 0.2
    gu_bias = torch.randn(80, dtype=dtype)
    swiglu = F.silu(F.linear(x.float(), gate.float(), gu_bias[:40].float())) * F.linear(x.float(), up.float(), gu_bias[40:].float())
    torch.testing.assert_close(small(x, [gate, up], gu_bias, None, "swiglu").float(), swiglu, **tol)


def test_small_linear_refuses_bad_inputs_with_a_reason():
    small = torch.ops.cellserve.small_linear
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        small(torch.randn(5, 8), [w], None, None, "none")
    with pytest.raises(RuntimeError, match="x's dtype and K"):
        small(x, [torch.randn(4, 9)], None, None, "none")
    with pytest.raises(RuntimeError, match="op must be"):
        small(x, [w], None, None, "gelu")
    with pytest.raises(RuntimeError, match="needs `other`"):
        small(x, [w], None, None, "add")
    with pytest.raises(RuntimeError, match="exactly \\[gate, up\\]"):
        small(x, [w], None, None, "swiglu")
    with pytest.raises(RuntimeError, match="one value per weight row"):
        small(x, [w], torch.randn(3), None, "none")


def test_a_build_killed_midway_does_not_block_the_next(tmp_path):
    """torch's build lock is a file; a build killed mid-compile leaves it, and the next start must not
    wait on it forever (it falls through to the compile, which here fails fast: a broken source)."""
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    code = (
        "import sys; from pathlib import Path; from engine.model.kernels import build as kernels\n"
        "kernels.SOURCES = (Path(sys.argv[1]),)\n"
        "d = kernels.build_directory(); d.mkdir(parents=True); (d / 'lock').touch()\n"
        "print(kernels.load(), kernels.why_not())\n"
    )
    got = subprocess.run([sys.executable, "-c", code, str(broken)], capture_output=True, text=True, check=False,
                         env={**os.environ, "CELLSERVE_KERNEL_CACHE": str(tmp_path / "cache")}, timeout=120)
    assert got.stdout.startswith("False build failed"), (got.stdout, got.stderr)


def test_without_kernels_the_native_forward_falls_back(tmp_path):
    """CELLSERVE_KERNELS=0, or a source that does not compile, leaves load() False with the reason."""
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    code = (
        "import sys; from pathlib import Path; from engine.model.kernels import build as kernels\n"
        "if sys.argv[1] == 'broken': kernels.SOURCES = (Path(sys.argv[2]),)\n"
        "print(kernels.load(), kernels.why_not())\n"
    )
    env_off = {"CELLSERVE_KERNELS": "0"}
    env_broken = {"CELLSERVE_KERNEL_CACHE": str(tmp_path / "cache")}
    for mode, extra, expect in (("off", env_off, "False CELLSERVE_KERNELS=0"), ("broken", env_broken, "False build failed")):
        got = subprocess.run([sys.executable, "-c", code, mode, str(broken)], capture_output=True, text=True, check=False,
                             env={**os.environ, **extra}, timeout=300)
        assert got.stdout.startswith(expect), (got.stdout, got.stderr)

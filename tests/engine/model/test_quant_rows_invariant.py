"""Row invariance of the quantized linears (engine/model/native/rows.py): up to `INVARIANT_ROWS` rows, each
row of a QuantLinear call is bitwise the row a call with it alone gives, for every kind and verb, so a
speculative step's drafted rows round exactly as one-row decode steps do. quant_gemm sums in another order
than the row kernel, so this fails wherever a call of 2-16 rows takes the GEMM; more rows may, and are
checked only within the integer kernels' bound against dequantize-then-`F.linear`.
"""

import pytest
import torch
import torch.nn.functional as F
from test_quant_linear import KINDS, _k, _round_activations, _weight  # puts tests/engine/loader on sys.path

from engine.loader.gguf_tensors import KIND_IDS
from engine.model.kernels import build as kernels
from engine.model.native.quant import QuantLinear
from engine.model.native.quant_tiles import TILED_KINDS
from engine.model.native.rows import INVARIANT_ROWS, drafted_step

N = 70  # two 32-row GEMM tasks and a partial one (swiglu: 35 = 16 + 16 + 3)
# long enough that the GEMM's and the row kernel's fp32 sums part (the 32-weight kinds: 33 blocks, a
# lone one at the end, so the row layout's kernels, not quant_tiles; the K-quants: 5 super-blocks)
K = {kind: 1056 if kind not in ("q4_k", "q5_k", "q6_k") else _k(kind, 160) for kind in KINDS}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.load(), kernels.why_not()


def _case(kind: str, rows: int, seed: int = 0, k: int | None = None):
    """A linear with a bias, `rows` rows of x at several scales (one all-zero block) and `other`."""
    k = k or K[kind]
    w, ref = _weight(kind, N, k, seed=seed)
    g = torch.Generator().manual_seed(seed + rows)
    x = torch.randn(rows, k, generator=g) * (0.1 + torch.rand(rows, 1, generator=g) * 8)
    x[0, 32:64] = 0
    bias, other = torch.randn(N, generator=g), torch.randn(rows, N, generator=g)
    lin = QuantLinear(w, bias)
    lin.small = True
    return lin, ref, x, other


VERBS = {"call": lambda lin, x, o: lin(x), "plus": lambda lin, x, o: lin.plus(x, o),
         "swiglu": lambda lin, x, o: lin.swiglu(x), "silu": lambda lin, x, o: lin.silu(x),
         "times": lambda lin, x, o: lin.times(x, o)}


def _assert_rows_as_alone(lin, x, other) -> None:
    """In a step with drafts, for each verb: every row of each call of the first m rows (m = 1 .. all) equals
    that row alone."""
    with drafted_step(True):
        _rows_as_alone(lin, x, other)


def _rows_as_alone(lin, x, other, verbs=tuple(VERBS)) -> None:
    for name in verbs:
        verb = VERBS[name]
        alone = [verb(lin, x[i:i + 1].clone(), other[i:i + 1].clone()) for i in range(x.shape[0])]
        for m in range(1, x.shape[0] + 1):
            y = verb(lin, x[:m].contiguous(), other[:m].contiguous())
            for i in range(m):
                assert torch.equal(y[i:i + 1], alone[i]), f"{name}: row {i} of {m} differs from the row alone"


@pytest.mark.parametrize("kind,k", [(kind, K[kind]) for kind in KINDS] + [(kind, 1024) for kind in TILED_KINDS])
def test_quant_linear_rows_as_alone(kind, k):
    """QuantLinear with the kernels, 1 to INVARIANT_ROWS rows, every verb, with a bias: each row bitwise
    as alone (with VNNI quant_tiles where the weight is tiled (K = 1024), else the row kernel; fp32 tiles
    without)."""
    lin, _, x, other = _case(kind, INVARIANT_ROWS, k=k)
    assert lin.tiled == (k == 1024)
    _assert_rows_as_alone(lin, x, other)
    if torch.ops.cellserve.quant_linear_fast() and lin.tiled:
        # quant_tiles (the 32-weight kinds) at every row count, in steps with drafts or without (the kernel's
        # verbs: `silu` and `times` add torch's elementwise ops, row by row only in steps with drafts)
        assert lin.path(x) == lin.path(torch.cat([x, x])) == "tiles"
        _rows_as_alone(lin, x, other, verbs=("call", "plus", "swiglu"))
    elif torch.ops.cellserve.quant_linear_fast():
        with drafted_step(True):
            assert lin.path(x) == "rows" and lin.path(torch.cat([x, x[:1]])) == "gemm"
        # a step without drafts keeps the faster GEMM past the row kernel's own crossover
        assert lin.path(x[: lin.row_rows]) == "rows" and lin.path(x[: lin.row_rows + 1]) == "gemm"


@pytest.mark.parametrize("kind", list(KINDS))
def test_gemm_off_and_eager_rows_as_alone(kind):
    """The GEMM switched off (the row kernel with VNNI) and no kernels at all (fp32 tiles, eager): each row
    bitwise as alone up to INVARIANT_ROWS rows too."""
    lin, _, x, other = _case(kind, INVARIANT_ROWS, seed=1)
    lin.gemm = False
    _assert_rows_as_alone(lin, x, other)
    lin.small = False
    lin.tile = 16  # several tiles, the last one partial
    assert lin.path(x) == "fp32"
    _assert_rows_as_alone(lin, x[:5], other[:5])


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("op", ["none", "add", "swiglu"])
def test_row_kernel_groups_rows_as_alone(kind, op):
    """quant_linear itself at any row count (groups of 8 per weight row, then the rest: 8 + 8 + 4 at 20):
    each row as alone, every op, with a bias."""
    lin, _, x, other = _case(kind, 20, seed=2)
    tensors, kid = _weight(kind, N, K[kind], seed=2)[0].tensors(), KIND_IDS[kind]  # the row layout
    n_out = N // 2 if op == "swiglu" else N
    other = other[:, :n_out].contiguous() if op == "add" else None

    def run(a, o):
        return torch.ops.cellserve.quant_linear(a, tensors, kid, lin.bias, o, op)

    alone = torch.cat([run(x[i:i + 1].clone(), None if other is None else other[i:i + 1].clone()) for i in range(20)])
    for m in (2, 7, 8, 9, 15, 16, 17, 20):
        assert torch.equal(run(x[:m].contiguous(), None if other is None else other[:m].contiguous()), alone[:m])


@pytest.mark.parametrize("kind", list(KINDS))
def test_more_rows_within_the_bound(kind):
    """Past INVARIANT_ROWS (the GEMM with VNNI): still within the integer kernels' bound against
    dequantize-then-`F.linear` (fp32 tiles without VNNI: within float summation)."""
    for rows in (INVARIANT_ROWS + 1, 24, 37):
        lin, ref, x, other = _case(kind, rows, seed=3)
        want = F.linear(x, ref, lin.bias)
        if lin.is_small(x):
            _, da = _round_activations(x, kind)
            bound = (da / 2) @ ref.abs().T + 1e-4 * (1 + want.abs())
        else:
            bound = 1e-4 * (1 + want.abs())
        assert ((lin(x) - want).abs() <= bound).all()
        assert ((lin.plus(x, other) - other - want).abs() <= bound + 1e-5 * (1 + other.abs())).all()
        gu = lin.swiglu(x)
        y = lin(x)
        torch.testing.assert_close(gu, F.silu(y[:, : N // 2]) * y[:, N // 2:], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("qtype", ["q4_k_m", "q8_0", "q4_1"])
def test_gguf_drafted_rows_give_the_decode_rows_logits(qtype, tmp_path):
    """End to end on a GGUF served quantized (tests/engine/model/test_row_invariance.py's check): a sequence's
    next tokens decoded one step at a time give logits bitwise equal to their rows in one verification-like
    step of 9 drafted rows beside another sequence's decode row (10 rows: the old GEMM path from 4 or 9)."""
    import gguf
    from test_row_invariance import assert_drafted_rows_match_decode
    from tiny_gguf import q4_k_m, tiny_llama, write_llama_gguf

    from engine.loader.source import resolve_model
    from engine.model.runner import ModelRunner

    if not torch.ops.cellserve.quant_linear_fast():
        pytest.skip("without VNNI the quantized linears run on fp32 tiles (rows.py: float32 is not invariant)")
    kinds = {"q4_k_m": lambda name: q4_k_m(name, 2), "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q4_1": gguf.GGMLQuantizationType.Q4_1}
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_llama(seed=2, tied=False, big=True), kinds[qtype])
    folder = resolve_model(str(path), "quantized", home=tmp_path / "home", progress=False).path

    def prompt(n, seed):
        return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    assert_drafted_rows_match_decode(lambda: ModelRunner.from_pretrained(folder, n_cells=256), prompt)

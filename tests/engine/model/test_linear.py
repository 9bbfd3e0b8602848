"""The native forward's float linears (engine/model/native/linear.py) against F.linear: one copy of each
weight (the oneDNN-packed one, which the one-row kernel `packed_linear` reads too), the transformers modules'
weights released once the native forward runs a loaded model; and GroupLinear over a mix of quantized and
float parts."""

import pytest
import torch
import torch.nn.functional as F
from cpu_features import has_amx
from gguf import GGMLQuantizationType, quants
from tiny_models import full_logits
from transformers import AutoModelForCausalLM

from engine.core.state.identity import identity_of
from engine.loader.gguf_tensors import pack_blocks
from engine.model.kernels import build as kernels
from engine.model.native.linear import Linear, expected_panels, panel_rows, small_swiglu
from engine.model.native.quant import CastLinear, GroupLinear, QuantLinear, linear_of
from engine.model.native.rows import INVARIANT_ROWS
from engine.model.runner import ModelRunner


def test_group_linear_takes_a_float32_linear():
    """A GGUF layer whose Q|K|V mixes a quantized part and a float32 one (linear_of makes the float32 run a
    native `Linear`, which had no `out_features`: GroupLinear crashed building itself). Each slice of the
    output equals its own part's reference: dequantize-then-F.linear for the blocks (the kernels round x
    to int8 per 32-block: within 2% of the largest output), F.linear for float32, bf16 for the bf16 part."""
    g = torch.Generator().manual_seed(0)
    wq, wf, wb = (torch.randn(n, 64, generator=g) * 0.1 for n in (32, 16, 8))
    qw = pack_blocks(quants.quantize(wq.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0, 32, 64)
    bias = torch.randn(56, generator=g)
    lin = linear_of([qw, wf, wb.bfloat16()], bias)
    assert isinstance(lin, GroupLinear)
    assert [type(p) for p in lin.parts] == [QuantLinear, Linear, CastLinear]
    assert lin.out_features == 56
    x = torch.randn(3, 64, generator=g)
    y = lin(x)
    assert y.shape == (3, 56) and y.dtype == torch.float32
    ref_q = F.linear(x, qw.dequantize(), bias[:32])
    assert (y[:, :32] - ref_q).abs().max() <= 0.02 * ref_q.abs().max()
    torch.testing.assert_close(y[:, 32:48], F.linear(x, wf, bias[32:48]), rtol=1e-5, atol=1e-5)
    ref_b = F.linear(x.bfloat16(), wb.bfloat16()).float() + bias[48:]
    torch.testing.assert_close(y[:, 48:], ref_b, rtol=1e-2, atol=1e-2)
    # the residual form and the SiLU form go through the same parts
    other = torch.randn(3, 56, generator=g)
    torch.testing.assert_close(lin.plus(x, other), y + other)
    torch.testing.assert_close(lin.silu(x), F.silu(y))


def test_group_linear_takes_an_nn_linear():
    """A plain torch module built elsewhere has `out_features` too: GroupLinear runs it as one part."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(64, 16), torch.nn.Linear(64, 8, bias=False)
    group = GroupLinear([a, b])
    x = torch.randn(2, 64)
    with torch.inference_mode():
        torch.testing.assert_close(group(x), torch.cat([a(x), b(x)], 1))
    assert group.out_features == 24


# ----- one copy: the packed weight serves every row count --------------------------------------------------

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # bf16: x and W are bf16 already, the sum is fp32, the
# output is rounded once to bf16 (8 bits of mantissa: 2^-8 = 0.4% of the largest output, doubled for margin
# and for the reference's own rounding)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err <= TOL[dtype], f"{dtype}: relative error {err:.2e} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 64), (33, 17), (130, 70)])  # whole panels, and padding in N and K
def test_packed_linear_kernel_against_f_linear(dtype, shape):
    """`packed_linear` over W laid out as oneDNN packs it (`expected_panels`, built here from W: the kernel
    is checked on its own, not through oneDNN) gives F.linear's result at 1-4 rows, for none/add/swiglu."""
    assert kernels.load(), kernels.why_not()
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    w, gate = (torch.randn(n, k, generator=g).to(dtype) for _ in range(2))
    bias = torch.randn(2 * n, generator=g)
    panels, gate_panels = expected_panels(w), expected_panels(gate)
    for rows in (1, 2, 3, 4):
        x, other = torch.randn(rows, k, generator=g).to(dtype), torch.randn(rows, n, generator=g).to(dtype)
        ref = F.linear(x.float(), w.float(), bias[:n])
        _close(torch.ops.cellserve.packed_linear(x, [panels], n, bias[:n], None, "none"), ref, dtype)
        _close(torch.ops.cellserve.packed_linear(x, [panels], n, bias[:n], other, "add"), ref + other.float(), dtype)
        want = F.silu(F.linear(x.float(), gate.float(), bias[:n])) * F.linear(x.float(), w.float(), bias[n:])
        _close(torch.ops.cellserve.packed_linear(x, [gate_panels, panels], n, bias, None, "swiglu"), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_rows_are_the_weights_rows(dtype):
    """A tied embedding reads its rows from the head's panels: exactly W[index] (a copy of values)."""
    w = torch.randn(100, 70).to(dtype)
    index = torch.tensor([0, 99, 63, 64, 31, 32, 5, 5])
    assert torch.equal(panel_rows(expected_panels(w), index, 70), w[index])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_keeps_one_copy(dtype):
    """Where oneDNN packs the weight in the layout packed_linear reads (checked byte for byte, as Linear
    does), the Linear keeps the packed weight only (no plain weight, no parts) and one-row calls read it;
    elsewhere it keeps what its paths need. Every path gives F.linear's result."""
    assert kernels.load(), kernels.why_not()
    torch.manual_seed(0)
    parts, b = [torch.randn(64, 80).to(dtype), torch.randn(32, 80).to(dtype)], torch.randn(96).to(dtype)
    lin = Linear(parts, b)
    lin.small = lin.parts is not None or lin.panels is not None
    if lin.panels is not None:  # on this CPU (AVX-512; bf16 with AVX512-BF16): one copy
        assert lin.parts is None and lin.weight is None
        assert lin.panels.untyped_storage().data_ptr() == torch.ops.cellserve.packed_bytes(lin.packed).data_ptr()
        assert torch.equal(lin.panels, expected_panels(torch.cat(parts)))
    elif lin.packed is not None:
        assert lin.weight is None  # the packed copy, plus the parts only where small_linear needs them
    w = torch.cat(parts).float()
    for rows in (1, 3):
        x, other = torch.randn(rows, 80).to(dtype), torch.randn(rows, 96).to(dtype)
        ref = F.linear(x.float(), w, b.float())
        assert lin.is_small(x) == (lin.small and rows <= (INVARIANT_ROWS if lin.amx else 1))
        _close(lin(x), ref, dtype)
        _close(lin.plus(x, other), ref + other.float(), dtype)


def test_one_copy_survives_a_model_load(model_dir):
    """`from_pretrained`'s runner keeps the native forward's weights only: every transformers parameter is
    a zero-byte placeholder, a tied embedding is looked up in the head's packed copy, and the logits are
    the float32 oracle's (loaded by the test itself); the cells' identity is the loaded weights' (a runner
    over a model the test holds, whose weights are kept, gets the same fingerprint)."""
    runner = ModelRunner.from_pretrained(model_dir, dtype="float32", n_cells=64)
    oracle = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    params = list(runner.model.parameters())
    assert params and all(p.untyped_storage().nbytes() <= p.element_size() for p in params)
    native = runner.native
    if native.head.panels is not None and oracle.config.tie_word_embeddings:
        assert native.embed == native.head.rows
    ids = list(range(3, 40))
    got = runner.run({0: (ids, 0)})[0]
    torch.testing.assert_close(got, full_logits(oracle, ids)[-1], atol=1e-4, rtol=0)
    kept = ModelRunner(oracle, n_cells=64)
    assert identity_of(runner) == identity_of(kept)
    assert all(p.untyped_storage().nbytes() > p.element_size() for p in oracle.parameters())


@pytest.mark.parametrize("shape", [(96, 64), (130, 70), (40, 576)])  # whole panels and steps, padding in N and K
def test_amx_rows_are_each_what_they_are_alone(shape):
    """bf16 on AMX: every row of a 1-16-row call (none, add, swiglu, with a bias) is bitwise the row computed
    alone, and bitwise what oneDNN's packed linear gives at any row count (so a drafted row rounds as a decode
    row, and as a prefill row would); close to F.linear in fp32."""
    torch.manual_seed(0)
    n, k = shape
    parts = [(torch.randn(n, k) * 0.1).bfloat16() for _ in range(2)]
    bias = torch.randn(n).bfloat16()
    lin, gate, up = Linear([parts[0]], bias), Linear([parts[0]]), Linear([parts[1]])
    if not has_amx():  # a CPU without AMX never takes the AMX path (amx_linear would refuse)
        assert not any(m.amx for m in (lin, gate, up))
        x = torch.randn(5, k).bfloat16()
        _close(lin(x), F.linear(x.float(), parts[0].float(), bias.float()), torch.bfloat16)
        return
    for m in (lin, gate, up):
        assert m.amx
        m.small = True
    x, other = torch.randn(INVARIANT_ROWS + 1, k).bfloat16(), torch.randn(INVARIANT_ROWS + 1, n).bfloat16()
    dnn = torch.ops.mkldnn._linear_pointwise(x, lin.packed, lin.bias, "none", [], "")
    calls = {"none": lambda a, o: lin(a), "add": lambda a, o: lin.plus(a, o),
             "swiglu": lambda a, o: small_swiglu(gate, up, a, None)}
    for op, call in calls.items():
        alone = torch.cat([call(x[i:i + 1], other[i:i + 1]) for i in range(INVARIANT_ROWS)])
        for rows in (1, 2, 9, INVARIANT_ROWS):
            assert lin.is_small(x[:rows])
            assert torch.equal(call(x[:rows], other[:rows]), alone[:rows]), (op, rows)
        if op == "none":
            assert torch.equal(alone, dnn[:INVARIANT_ROWS])
    assert not lin.is_small(x)  # past the limit: oneDNN
    ref = F.linear(x.float(), parts[0].float(), bias.float())
    _close(lin(x[:5]), ref[:5], torch.bfloat16)

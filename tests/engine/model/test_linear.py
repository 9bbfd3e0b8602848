"""The native forward's float linears (engine/model/native/linear.py) against F.linear, and GroupLinear over
a mix of quantized and float parts."""

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from engine.loader.gguf_tensors import pack_blocks
from engine.model.native.linear import Linear
from engine.model.native.quant import CastLinear, GroupLinear, QuantLinear, linear_of


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

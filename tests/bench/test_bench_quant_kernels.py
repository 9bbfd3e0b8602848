"""`python -m engine.bench.quant_kernels` runs every path of the quantized linear and marks the fastest."""

import pytest

from engine.bench import quant_kernels
from engine.model.kernels import build as kernels


@pytest.mark.skipif(not kernels.load(), reason="the fused kernels are not built")
def test_quant_kernels_bench_runs_every_path(capsys):
    assert quant_kernels.main(["--kinds", "q4_1,q4_k", "--shapes", "64x96,32x256", "--rows", "1,5,90",
                               "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "q4_k 64x96: skipped" in out  # K not whole 256-weight super-blocks
    assert out.count("*") >= 9  # one fastest path marked per (shape, rows): 3 shapes x 3 row counts
    assert out.count("tiles") == 1  # q4_1 32x256 only: 64x96 is an odd block count, left in the row layout
    for name in ("rows", "gemm", "tiles", "fp32", "bf16 dense"):
        assert name in out
